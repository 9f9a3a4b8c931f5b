"""The storage format of quantized weights (pure PyTorch, what ``quant_kernel`` reads) and the
round-to-nearest quantizers: tiles of 16 output rows, int4 two values a byte, scales and mins
per group of inputs; and the kernel's own activation quantization (llama.cpp's Q8 blocks)
for tests to check it against.

Layout (the last tile padded with zero rows): int4 ``qweight`` uint8 ``[T, K / 8, 16, 4]``,
byte ``(t, c, r, j)`` holding ``q[16 t + r, 8 c + j]`` in its low nibble and
``q[16 t + r, 8 c + 4 + j]`` in its high one; int8 ``qweight`` int8 ``[T, K / 4, 16, 4]``
holding ``q[16 t + r, 4 c + j]``; ``scales`` / ``mins`` ``[T, K / group_size, 16]``.
"""

from __future__ import annotations

import torch

from atlas_vlm.kernels import quant_kernel

TILE = quant_kernel.TILE
INT4_GROUP_SIZES = (128, 64, 32)  # default group first
DEFAULT_INT4_GROUP_SIZE = 128
FP16_NORMAL_MIN, FP16_MAX = 2.0**-14, 65504.0


def int4_group_size(in_features: int, preferred: int = DEFAULT_INT4_GROUP_SIZE) -> int:
    """The int4 group size for a layer of ``in_features`` inputs: ``preferred`` (128) when it
    divides ``in_features``, else the largest of 64 and 32 that does (SmolLM2's 576 -> 64).

    Raises:
        ValueError: ``in_features`` is not a multiple of 32.
    """
    for g in (preferred,) + tuple(s for s in INT4_GROUP_SIZES if s < preferred):
        if in_features % g == 0:
            return g
    raise ValueError(f"int4 needs in_features divisible by 32 (a group size), got {in_features}")


def num_tiles(rows: int) -> int:
    """Tiles of 16 rows holding ``rows`` output rows."""
    return -(-rows // TILE)


# ---- tile layout (pure PyTorch; the kernel reads the same bytes) --------------------------------

def row_view(t: torch.Tensor) -> torch.Tensor:
    """``[T, C, 16, ...]`` -> a ``[T, 16, C, ...]`` view: ``[tile, row in tile]`` picks a row."""
    return t.transpose(1, 2)


def row_index(row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile, row in tile)`` index tensors of rows ``row .. row + n - 1``, for :func:`row_view`."""
    r = torch.arange(row, row + n)
    return r // TILE, r % TILE


def pack_int4_row(q: torch.Tensor) -> torch.Tensor:
    """``[n, K]`` values 0..15 -> ``[n, K / 8, 4]`` uint8: byte ``(c, j)`` = ``q[8c + j] | q[8c + 4 + j] << 4``."""
    b = q.to(torch.uint8).reshape(q.shape[0], -1, 2, 4)
    return b[:, :, 0] | (b[:, :, 1] << 4)


def unpack_int4_row(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_row`: ``[n, K / 8, 4]`` -> ``[n, K]`` uint8."""
    return torch.stack([b & 15, b >> 4], dim=2).reshape(b.shape[0], -1)


def to_tiles(values: torch.Tensor, per_row: tuple[int, ...]) -> torch.Tensor:
    """Rows ``[N, *per_row]`` -> tiles ``[T, per_row[0], 16, *per_row[1:]]`` (zero padded)."""
    n = values.shape[0]
    out = values.new_zeros(num_tiles(n), per_row[0], TILE, *per_row[1:])
    row_view(out)[row_index(0, n)] = values
    return out


def from_tiles(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """Tiles ``[T, C, 16, ...]`` -> rows ``[n, C, ...]``."""
    return row_view(tiles)[row_index(0, n)]


# ---- round-to-nearest quantizers ----------------------------------------------------------------

def fp16_exact(t: torch.Tensor) -> bool:
    """Every value of ``t`` is finite and exactly representable in fp16."""
    return bool(torch.isfinite(t).all()) and bool((t.abs() <= FP16_MAX).all()) and \
        torch.equal(t.to(torch.float16).float(), t)


def _round_scale(s: torch.Tensor) -> torch.Tensor:
    """Scales rounded to fp16 (at least its smallest normal) when they fit, else as they are."""
    if bool((s <= FP16_MAX).all()):
        return s.clamp(min=FP16_NORMAL_MIN).to(torch.float16).float()
    return s.clamp(min=1e-12)


def quantize_int8_rtn(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 of ``w`` ``[N, K]``: ``scale = absmax / 127`` per row
    (``group_size=None``) or per group of ``group_size`` columns, rounded to fp16 first (as
    llama.cpp's Q8_0) when it fits, then ``q = round(w / scale)``.

    Returns:
        ``q`` int8 ``[N, K]``, ``scales`` fp32 ``[N, K // group_size]``.
    """
    w = w.float()
    n, k = w.shape
    g = group_size or k
    wg = w.view(n, k // g, g)
    scales = _round_scale(wg.abs().amax(-1) / 127.0)  # [N, G]
    q = torch.round(wg / scales[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return q, scales


def quantize_int4_rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 of ``w`` ``[N, K]`` in groups of ``group_size``
    columns (gpt-fast's ``group_quantize_tensor``, llama.cpp's Q4_1): ``scale = (max - min) / 15``
    and ``min``, rounded to fp16 when they fit, then ``q = round((w - min) / scale)`` in ``[0, 15]``.

    Returns:
        ``q`` uint8 ``[N, K]``, ``scales`` and ``mins`` fp32 ``[N, K // group_size]``.
    """
    w = w.float()
    n, k = w.shape
    wg = w.view(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = _round_scale((hi - lo) / 15.0)
    mins = lo.to(torch.float16).float() if bool((lo.abs() <= FP16_MAX).all()) else lo
    q = torch.round((wg - mins[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return q, scales, mins


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` fp32 (``K % 32 == 0``) as the kernel sees it: per block of 32 values
    ``d = amax / 127``, ``q = round(x * (1 / d))`` (0 where ``d == 0``), returned as ``q * d``
    (NaN for a block holding a NaN or an infinity). llama.cpp's Q8 activations."""
    m, k = x.shape
    xb = x.view(m, k // quant_kernel.QBLOCK, quant_kernel.QBLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)
    out = q * d
    bad = ~torch.isfinite(xb).all(-1, keepdim=True)
    return torch.where(bad, torch.full_like(out, float("nan")), out).view(m, k)
