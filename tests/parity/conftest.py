"""Fixtures of the stage 4 (VLM) parity tests: the tiny random Qwen2.5-VL and an engine on it."""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, CPU_FP32, MAX_MODEL_LEN
from atlas_vlm import LLM


@pytest.fixture(scope="module")
def vl(tiny_models):
    folder, hf = tiny_models["qwen2_5_vl"]
    return folder, hf.eval()


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(str(vl[0]), max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=512, kvcache_block_size=BLOCK_SIZE,
               **CPU_FP32)
