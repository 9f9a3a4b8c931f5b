"""The planner's weight bytes per quantization scheme equal what the engine's loaded
quantized model holds (tiny random models in bf16 and fp32, kernel on and off; one whose
projection rows are not a multiple of the 16-row tile), and its per-projection arithmetic in
literal values: fp16 scales whatever the model's dtype, rows padded to tiles, fp32 AWQ / GPTQ
scales and mins."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
from atlas_vlm import LLM
from atlas_vlm.layers import quant_linear
from atlas_vlm.memory_plan import GiB, plan
from atlas_vlm.quantization.sizes import decoder_projections, projection_bytes, text_weight_bytes

pytestmark = pytest.mark.text


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    """A tiny random Qwen3 whose qkv_proj has 40 rows (8 heads of 4, one KV head): its last
    tile holds 8 padding rows."""
    folder = tmp_path_factory.mktemp("padded")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=1, head_dim=4, max_position_embeddings=1024,
                      tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(qwen_tokenizer_dir()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("dtype,nbytes", [("bfloat16", 2), ("float32", 4)])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "padded"])
def test_planned_bytes_equal_loaded_bytes(family, method, dtype, nbytes, kernel, tiny_models, padded_model,
                                          monkeypatch):
    folder = padded_model if family == "padded" else tiny_models[family][0]
    monkeypatch.setattr(quant_linear, "quant_kernel_available", lambda *a, **k: kernel)
    llm = LLM(str(folder), quantization=method, dtype=dtype, max_model_len=128, num_kvcache_blocks=4)
    model = llm.engine.runner.model
    cfg = AutoConfig.from_pretrained(folder)
    if family == "padded":
        assert (64, 40) in decoder_projections(cfg)  # qkv_proj: K = 64, N = 40 -> 48 rows held
    mods = quant_linear.quantized_modules(model)
    assert all(m.use_kernel == kernel and m.scales.dtype == torch.float16 for m in mods)
    decoder = model.model  # the LM head may be a PackedLinear (CPU bf16: oneDNN layout, not a parameter)
    held = sum(t.numel() * t.element_size() for t in list(decoder.parameters()) + list(decoder.buffers()))
    if not cfg.tie_word_embeddings:
        held += cfg.vocab_size * cfg.hidden_size * nbytes  # the dense LM head
    assert held == text_weight_bytes(cfg, method, nbytes)
    assert plan(cfg, gpu_memory=8 * GiB, quantization=method, dtype=dtype).weight_bytes == held
    assert held < text_weight_bytes(cfg, None, nbytes)


def test_projection_bytes_per_scheme():
    # Qwen2.5-VL-3B's down_proj: K = 11008 inputs (group 128 divides it), N = 2048 outputs (128 tiles)
    k, n = 11008, 2048
    assert projection_bytes(k, n, None, 2) == 45_088_768  # N K 2 (bf16)
    assert projection_bytes(k, n, None, 4) == 90_177_536
    for b in (2, 4):  # scales are fp16 whatever the model's dtype
        assert projection_bytes(k, n, "int8", b) == 22_548_480  # N K + N 2
        assert projection_bytes(k, n, "int4", b) == 11_976_704  # N K / 2 + 2 (K / 128) N 2
        assert projection_bytes(k, n, "awq", b) == projection_bytes(k, n, "gptq", b) == 12_681_216  # fp32: .. N 4
    # rows padded to tiles of 16: 72 -> 80 rows; 576 inputs: int4 group 64
    assert projection_bytes(576, 72, "int4", 2) == 25_920  # 80 * 288 + 2 * 9 * 80 * 2
    assert projection_bytes(576, 72, "int8", 4) == 46_240  # 80 * 576 + 80 * 2
    assert projection_bytes(64, 40, "int4", 2) == 1_728  # 40 -> 48 rows: 48 * 32 + 2 * 1 * 48 * 2 (group 64)
    with pytest.raises(ValueError, match="'fp8'"):
        projection_bytes(k, n, "fp8", 2)
