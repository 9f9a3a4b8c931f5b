"""8-bit K/V storage: one scale per (token, KV head), no calibration.

The rule is vLLM's ``int8_per_token_head`` / ``fp8_per_token_head`` (PR #38378): each new
token's K (and V) row of one head, ``[head_dim]`` values, is stored as 8-bit codes with one
scale ``amax(|row|) / QMAX``; reading multiplies back. ``int8`` rounds to nearest (codes in
[-127, 127]); ``fp8_e4m3`` casts ``row / scale`` to float8 e4m3 (round to nearest even, codes
in [-448, 448]) and is kept as raw bytes (``uint8``: CPU ``index_copy_`` has no float8 kernel).
Scales are float16: 2 bytes per (token, head) instead of 4, so an int8 cache with head_dim 64
holds 128 / 66 = 1.94x the tokens of a bf16 one in the same bytes. A row of zeros gets the
smallest normal float16 scale (codes 0, dequantized exactly); a row whose amax / QMAX exceeds
float16's range (|K| > 8.3e6 in int8, a model would be broken long before) is clamped to
65504 per code and so saturates.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # "auto": the model's dtype, no scales
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
SCALE_DTYPE = torch.float16
_SCALE_MIN, _SCALE_MAX = 2.0 ** -14, 65504.0  # float16's smallest normal and largest value


def check_kv_cache_dtype(name: str) -> str:
    """Validate a ``kv_cache_dtype``.

    Raises:
        ValueError: not one of ``KV_CACHE_DTYPES`` (named), or ``fp8_e4m3`` where this torch
            has no ``float8_e4m3fn``.
    """
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if name == "fp8_e4m3" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"kv_cache_dtype='fp8_e4m3' needs torch.float8_e4m3fn, absent in torch {torch.__version__}")
    return name


def quantize_per_token_head(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[num_tokens, kv_heads, head_dim]`` -> (codes ``[num_tokens, kv_heads, head_dim]``
    in ``STORAGE_DTYPES[kv_dtype]``, scales ``[num_tokens, kv_heads]`` float16)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / QMAX[kv_dtype]).clamp(_SCALE_MIN, _SCALE_MAX).to(SCALE_DTYPE)  # [T, kvh]
    y = xf / scale.float().unsqueeze(-1)
    if kv_dtype == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), scale
    codes = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def dequantize_per_token_head(codes: torch.Tensor, scale: torch.Tensor, kv_dtype: str,
                              dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_per_token_head``: codes ``[..., kv_heads, head_dim]`` and scales
    ``[..., kv_heads]`` -> values in ``dtype`` (computed in fp32, rounded once)."""
    values = codes.view(torch.float8_e4m3fn).float() if kv_dtype == "fp8_e4m3" else codes.float()
    return (values * scale.float().unsqueeze(-1)).to(dtype)
