"""Server test fixtures: the text server (embedded SmolLM2) and the VLM server (tiny random
Qwen2.5-VL) as subprocesses for the whole session, stopped in their finalizers, and the
in-process ``LLM`` references on the same models and settings."""

from __future__ import annotations

import pytest

from helpers import IMAGES
from server_process import TEXT_ARGS, TEXT_LLM_KWARGS, VLM_ARGS, VLM_LLM_KWARGS, ServerProcess


@pytest.fixture(scope="session")
def text_server():
    server = ServerProcess(None, *TEXT_ARGS, name="smollm2")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def text_llm():
    from atlas_vlm import LLM
    from atlas_vlm.default_models import default_text_model

    return LLM(default_text_model(), **TEXT_LLM_KWARGS)


@pytest.fixture(scope="session")
def vlm_server(tiny_models):
    folder = str(tiny_models["qwen2_5_vl"][0])
    server = ServerProcess(folder, *VLM_ARGS, "--allowed-local-media-path", str(IMAGES), "--allow-http-images",
                           "--allowed-media-domains", "127.0.0.1", "--max-image-bytes", "300KiB", name="tiny-vl")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vlm_llm(tiny_models):
    from atlas_vlm import LLM

    return LLM(str(tiny_models["qwen2_5_vl"][0]), **VLM_LLM_KWARGS)
