"""The planner's weight bytes per quantization scheme equal what the engine's loaded
quantized model holds (tiny random models, bf16, kernel on and off)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from atlas_vlm import LLM
from atlas_vlm.layers import quant_linear
from atlas_vlm.memory_plan import GiB, plan
from atlas_vlm.quantization.sizes import projection_bytes, text_weight_bytes

pytestmark = pytest.mark.text


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_planned_bytes_equal_loaded_bytes(family, method, kernel, tiny_models, monkeypatch):
    folder, _ = tiny_models[family]
    monkeypatch.setattr(quant_linear, "quant_kernel_available", lambda *a, **k: kernel)
    llm = LLM(str(folder), quantization=method, dtype="bfloat16", max_model_len=128, num_kvcache_blocks=4)
    model = llm.engine.runner.model
    cfg = AutoConfig.from_pretrained(folder)
    decoder = model.model  # the LM head may be a PackedLinear (CPU bf16: oneDNN layout, not a parameter)
    held = sum(t.numel() * t.element_size() for t in list(decoder.parameters()) + list(decoder.buffers()))
    if not cfg.tie_word_embeddings:
        held += cfg.vocab_size * cfg.hidden_size * 2  # the dense bf16 LM head
    assert held == text_weight_bytes(cfg, method, 2)
    assert plan(cfg, gpu_memory=8 * GiB, quantization=method).weight_bytes == held
    assert held < text_weight_bytes(cfg, None, 2)


def test_projection_bytes_per_scheme():
    # Qwen2.5-VL-3B's down_proj: K = 11008 inputs (group 128 divides it), N = 2048 outputs, bf16
    k, n = 11008, 2048
    assert projection_bytes(k, n, None, 2) == n * k * 2
    assert projection_bytes(k, n, "int8", 2) == n * k + n * 2
    assert projection_bytes(k, n, "int4", 2) == n * k // 2 + 2 * (k // 128) * n * 2
    assert projection_bytes(576, 64, "int4", 2) == 64 * 288 + 2 * 9 * 64 * 2  # 576: group 64
    with pytest.raises(ValueError, match="'fp8'"):
        projection_bytes(k, n, "fp8", 2)
