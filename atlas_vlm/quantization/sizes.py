"""Weight bytes per quantization scheme, from a config alone (the planner's and the engine's
shared arithmetic; tests compare it with the bytes the loaded modules hold).

Per decoder projection of ``K`` inputs and ``N`` outputs, scales and zeros in the compute
dtype of ``b`` bytes (bf16: 2):

- dense: ``N K b``
- ``"int8"``: ``N K`` + one scale per output ``N b``
- ``"int4"`` / ``"awq"`` / ``"gptq"`` / ``"gguf"`` (4-bit): ``N K / 2`` + a scale and a zero per
  group of ``g`` inputs ``2 (K / g) N b``; ``g = int4_group_size(K)`` (128, else 64 / 32) for
  int4, 128 for AWQ / GPTQ releases, 32 for GGUF Q4 blocks.

Embeddings, the LM head, norms, biases and the vision tower stay dense (``b`` bytes each).
"""

from __future__ import annotations

from atlas_vlm.layers.quant_linear import int4_group_size
from atlas_vlm.models.param_count import head_dim, num_kv_heads, text_config, text_params

PLAN_QUANTIZATIONS = ("int8", "int4", "awq", "gptq")


def decoder_projections(hf_config) -> list[tuple[int, int]]:
    """``(in_features, out_features)`` of every decoder projection (fused as ours:
    qkv_proj, o_proj, gate_up_proj, down_proj), all layers."""
    t = text_config(hf_config)
    h, hd, nh, nkv, inter = t.hidden_size, head_dim(t), t.num_attention_heads, num_kv_heads(t), t.intermediate_size
    layer = [(h, (nh + 2 * nkv) * hd), (nh * hd, h), (h, 2 * inter), (inter, h)]
    return layer * t.num_hidden_layers


def projection_bytes(k: int, n: int, quantization: str | None, dtype_bytes: int) -> int:
    """Bytes of one ``[n, k]`` projection's weight (no bias) under ``quantization``.

    Raises:
        ValueError: an unknown scheme (named).
    """
    b = dtype_bytes
    if quantization is None:
        return n * k * b
    if quantization == "int8":
        return n * k + n * b
    if quantization in ("int4", "awq", "gptq"):
        g = int4_group_size(k) if quantization == "int4" else 128
        return n * k // 2 + 2 * (k // g) * n * b
    raise ValueError(f"quantization must be None or one of {PLAN_QUANTIZATIONS}, got {quantization!r}")


def text_weight_bytes(hf_config, quantization: str | None, dtype_bytes: int) -> int:
    """Decoder weight bytes: ``text_params * b`` with each projection's dense bytes replaced
    by :func:`projection_bytes` under ``quantization``."""
    dense = text_params(hf_config) * dtype_bytes
    if quantization is None:
        return dense
    return dense + sum(projection_bytes(k, n, quantization, dtype_bytes) - n * k * dtype_bytes
                       for k, n in decoder_projections(hf_config))
