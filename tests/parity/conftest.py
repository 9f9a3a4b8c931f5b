"""Fixtures of the stage 4 (VLM) parity tests: each tiny random M-RoPE VLM (Qwen2.5-VL and
Qwen2-VL, ``VL_FAMILIES``) and an engine on it; every stage 4 test runs once per family."""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, CPU_FP32, MAX_MODEL_LEN
from atlas_vlm import LLM


VL_FAMILIES = ("qwen2_5_vl", "qwen2_vl")  # same prompt format, M-RoPE and image tokens; different towers


@pytest.fixture(scope="module", params=VL_FAMILIES)
def vl(tiny_models, request):
    folder, hf = tiny_models[request.param]
    return folder, hf.eval()


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(str(vl[0]), max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=512, kvcache_block_size=BLOCK_SIZE,
               **CPU_FP32)
