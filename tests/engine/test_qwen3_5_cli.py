"""Qwen3.5 where users meet it: ``scripts/generate.py --model DIR`` on a tiny random Qwen3.5
VLM (Qwen's real vocabulary and tokenizer, so text goes through the chat template as with a
released checkpoint) prints ``LLM``'s greedy text, for a text prompt and for an image prompt
(a real photo through the tower); the same folder's ``LLM.generate`` on a raw prompt agrees
with ``--no-chat``."""

from __future__ import annotations

import importlib.util

import pytest

from atlas_vlm import LLM, SamplingParams
from helpers import IMAGES, REPO
from qwen3_5_helpers import build_tiny_qwen3_5, tiny_vl_config

PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
PIXELS = ["--min-pixels", str(16 * PX), "--max-pixels", str(40 * PX)]
N = 8


def _cli():
    spec = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_cli")
    build_tiny_qwen3_5(folder, seed=5, config=tiny_vl_config())
    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=1024, num_kvcache_blocks=128,
              min_pixels=16 * PX, max_pixels=40 * PX)
    return folder, llm


def _run(folder, capsys, *args: str) -> str:
    rc = _cli().main(["--dtype", "float32", "--device", "cpu", "--model", str(folder), "--max-tokens", str(N),
                      "--max-model-len", "1024", *args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "[finish_reason=" in out.err
    return out.out


@pytest.mark.text
def test_text_prompt_equals_llm(q35, capsys):
    folder, llm = q35
    printed = _run(folder, capsys, "--prompt", "What is the capital of France?")
    expected = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    assert len(expected.token_ids) == N  # random weights: no early EOS, so N tokens are compared
    assert printed == expected.text + "\n"


@pytest.mark.text
def test_raw_prompt_equals_llm_generate(q35, capsys):
    folder, llm = q35
    printed = _run(folder, capsys, "--no-chat", "--prompt", "Once upon a time")
    expected = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    assert printed == expected.text + "\n"


@pytest.mark.vlm
def test_image_prompt_equals_llm(q35, capsys):
    folder, llm = q35
    photo = IMAGES / "chelsea.png"
    printed = _run(folder, capsys, *PIXELS, "--image", str(photo), "--prompt", "Describe this image.")
    conv = [{"role": "user", "content": [{"type": "image", "image": str(photo)},
                                         {"type": "text", "text": "Describe this image."}]}]
    expected = llm.chat(conv, SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    text_only = llm.chat([{"role": "user", "content": "Describe this image."}],
                         SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    assert printed == expected.text + "\n"
    assert expected.token_ids != text_only.token_ids  # the image reached the decoder


@pytest.mark.text
def test_hub_id_from_the_cache_offline(q35, capsys, tmp_path, monkeypatch):
    """``--model Qwen/Qwen3.5-0.8B`` resolves through huggingface_hub's cache as the chain's
    models do (a cache entry laid out here from the tiny folder; offline, nothing downloaded)."""
    import shutil

    folder, llm = q35
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--Qwen--Qwen3.5-0.8B"
    shutil.copytree(folder, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    printed = _run("Qwen/Qwen3.5-0.8B", capsys, "--prompt", "Hello")
    expected = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=N),
                        use_tqdm=False)[0]
    assert printed == expected.text + "\n"
