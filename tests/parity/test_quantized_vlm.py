"""Quantization at load on a VLM (tiny random Qwen2.5-VL): the decoder's projections are
quantized, the vision tower stays dense, and an image prompt gives HF's tokens and logits
(1e-4) on the same dequantized decoder weights (reference path)."""

from __future__ import annotations

import pytest
import torch

from helpers import IMAGES, SMALL, chat, conv, assert_matches_hf
from atlas_vlm import LLM
from atlas_vlm.layers import quant_linear
from atlas_vlm.layers.quant_linear import quantized_modules

pytestmark = pytest.mark.vlm


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_vlm_decoder_equals_hf_on_dequantized_weights(method, tiny_models, monkeypatch):
    from test_quantized_load import hf_dequantized

    folder, hf = tiny_models["qwen2_5_vl"]
    monkeypatch.setattr(quant_linear, "quant_kernel_available", lambda *a, **k: False)
    llm = LLM(str(folder), quantization=method, dtype="float32", max_model_len=2048, num_kvcache_blocks=64)
    model = llm.engine.runner.model
    assert len(quantized_modules(model)) == 4 * 2
    assert not quantized_modules(llm.engine.runner.vision.model if hasattr(llm.engine.runner.vision, "model")
                                 else llm.engine.runner.vision)  # the tower stays dense
    ref = hf_dequantized(hf, model, layers=lambda m: m.model.language_model.layers)
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    outs, rec = chat(llm, [c], 6, mm_options=SMALL)
    assert_matches_hf(llm, ref, c, outs[0], rec, 6, mm_options=SMALL)
