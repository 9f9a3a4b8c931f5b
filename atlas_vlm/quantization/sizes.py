"""Weight bytes per quantization scheme, from a config alone (the planner's and the engine's
shared arithmetic; tests compare it with the bytes the loaded modules hold).

Quantized weights are stored in tiles of 16 output rows (``quant_linear``), so a projection
of ``K`` inputs and ``N`` outputs holds ``N_pad = 16 * ceil(N / 16)`` rows. Scales (and mins)
keep their own dtype whatever the model's: fp16 where every value is exact in fp16, else fp32.
Per projection, the model's dtype taking ``b`` bytes (bf16: 2):

- dense: ``N K b``
- ``"int8"`` (round to nearest at load): ``N_pad K`` + one fp16 scale per row ``N_pad * 2``
- ``"int4"`` (round to nearest at load): ``N_pad K / 2`` + an fp16 scale and min per group of
  ``g`` inputs ``2 (K / g) N_pad * 2``; ``g = int4_group_size(K)`` (128, else 64 / 32)
- ``"awq"`` / ``"gptq"``: ``N_pad K / 2`` + an fp32 scale and min (``-z s``) per group of 128
  ``2 (K / 128) N_pad * 4`` (a symmetric GPTQ's ``-8 s`` is exact in fp16 and loads as fp16:
  half these scale bytes; the plan is the larger figure)

Embeddings, the LM head, norms, biases and the vision tower stay dense (``b`` bytes each).
A GGUF file is not planned from a config (``entrypoints/plan.py``).
"""

from __future__ import annotations

from atlas_vlm.layers.quant_linear import TILE, int4_group_size, num_tiles
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
    """Bytes of one ``[n, k]`` projection's weight (no bias) under ``quantization``; dense in
    ``dtype_bytes`` a value; quantized as the module docstring states (their scales are fp16 or
    fp32 whatever ``dtype_bytes``).

    Raises:
        ValueError: an unknown scheme (named).
    """
    if quantization is None:
        return n * k * dtype_bytes
    n_pad = num_tiles(n) * TILE
    if quantization == "int8":
        return n_pad * k + n_pad * 2
    if quantization == "int4":
        return n_pad * k // 2 + 2 * (k // int4_group_size(k)) * n_pad * 2
    if quantization in ("awq", "gptq"):
        return n_pad * k // 2 + 2 * (k // 128) * n_pad * 4
    raise ValueError(f"quantization must be None or one of {PLAN_QUANTIZATIONS}, got {quantization!r}")


def text_weight_bytes(hf_config, quantization: str | None, dtype_bytes: int) -> int:
    """Decoder weight bytes: ``text_params * b`` with each projection's dense bytes replaced
    by :func:`projection_bytes` under ``quantization``."""
    dense = text_params(hf_config) * dtype_bytes
    if quantization is None:
        return dense
    return dense + sum(projection_bytes(k, n, quantization, dtype_bytes) - n * k * dtype_bytes
                       for k, n in decoder_projections(hf_config))
