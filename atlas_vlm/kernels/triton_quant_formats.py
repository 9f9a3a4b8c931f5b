"""Dequantization in registers for the Triton quantized matmuls (``triton_quant``): one
``@triton.jit`` helper per stored format that turns a tile of ``(output row n, input k)``
index pairs into the fp32 weights ``W[n, k]``, reading the bytes exactly as stored.

Formats (``FMT`` ids; the GGUF ones are ``gguf.GGMLQuantizationType`` values):

- ``INT8`` / ``INT8_MIN``: ``Int8Linear``'s tiles (``layers/quant_format``): int8 ``q`` at byte
  ``((t * K/4 + k // 4) * 16 + r) * 4 + k % 4`` (``t, r = n // 16, n % 16``), ``W = q * s (+ m)``
  with ``s`` / ``m`` at ``(t * G + k // group) * 16 + r`` (fp16 or fp32).
- ``INT4``: ``Int4Linear``'s tiles: byte ``((t * K/8 + k // 8) * 16 + r) * 4 + k % 4``, the low
  nibble for ``k % 8 < 4``, else the high one; ``W = q * s + m`` (AWQ / GPTQ arrive here).
- ``Q4_0``, ``Q8_0``, ``Q4_K``, ``Q5_K``, ``Q6_K``: ggml blocks, rows of ``K / block`` blocks
  back to back, the formulas (and fp32 operation order) of gguf-py's ``quants.py``, so an fp32
  weight is bit-identical to ``gguf.quants.dequantize``.

Index tensors may be any broadcastable shapes (``[BN, 1]`` and ``[1, BK]`` or the transpose);
``ok`` masks the loads. Offsets are int64 (a vocabulary-sized head exceeds 2**31 nibbles).
"""

from __future__ import annotations

import triton
import triton.language as tl

INT8, INT8_MIN, INT4 = 100, 101, 102
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 8, 12, 13, 14  # gguf.GGMLQuantizationType
GGUF_BLOCK = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}  # (values, bytes)
# the same ids as constexpr globals: compiled Triton reads no other kind of global
_INT8, _INT8_MIN, _INT4 = tl.constexpr(INT8), tl.constexpr(INT8_MIN), tl.constexpr(INT4)
_Q4_0, _Q8_0, _Q4_K, _Q5_K = tl.constexpr(Q4_0), tl.constexpr(Q8_0), tl.constexpr(Q4_K), tl.constexpr(Q5_K)


@triton.jit
def _byte(p, off, ok):
    """The uint8 at ``p + off`` as int32 (0 where masked)."""
    return tl.load(p + off, mask=ok, other=0).to(tl.int32)


@triton.jit
def _half(p, off, ok):
    """The little-endian fp16 at bytes ``off, off + 1`` as fp32 (ggml blocks are byte arrays)."""
    bits = _byte(p, off, ok) | (_byte(p, off + 1, ok) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(p, blk, s, ok):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block ``s`` (0..7) from the 12 packed bytes at
    ``blk + 4`` (gguf-py ``Q4_K.get_scale_min``)."""
    lo = s < 4
    i = s % 4
    d_ = _byte(p, blk + 4 + i, ok)
    m_ = _byte(p, blk + 8 + i, ok)
    md = _byte(p, blk + 12 + i, ok)
    sc = tl.where(lo, d_ & 0x3F, (md & 0x0F) | ((d_ >> 2) & 0x30))
    mn = tl.where(lo, m_ & 0x3F, (md >> 4) | ((m_ >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def dequant(FMT: tl.constexpr, w_ptr, s_ptr, m_ptr, n, k, ok, K, group):
    """``W[n, k]`` in fp32 for format ``FMT`` (masked entries 0). ``w_ptr``: the quantized
    weight (uint8 / int8 bytes); ``s_ptr`` / ``m_ptr``: scales / mins (INT* only); ``K``: inputs
    per row; ``group``: the INT* group size."""
    n = n.to(tl.int64)
    k = k.to(tl.int64)
    if FMT == _INT8 or FMT == _INT8_MIN or FMT == _INT4:
        t = n // 16
        r = n % 16
        sm = (t * (K // group) + k // group) * 16 + r
        s = tl.load(s_ptr + sm, mask=ok, other=0.0).to(tl.float32)
        if FMT == _INT4:
            b = _byte(w_ptr, ((t * (K // 8) + k // 8) * 16 + r) * 4 + k % 4, ok)
            q = tl.where(k % 8 < 4, b & 15, b >> 4).to(tl.float32)
            w = q * s + tl.load(m_ptr + sm, mask=ok, other=0.0).to(tl.float32)
        else:
            q = tl.load(w_ptr + ((t * (K // 4) + k // 4) * 16 + r) * 4 + k % 4, mask=ok, other=0).to(tl.float32)
            w = q * s
            if FMT == _INT8_MIN:
                w = w + tl.load(m_ptr + sm, mask=ok, other=0.0).to(tl.float32)
    elif FMT == _Q8_0:
        blk = n * (K // 32 * 34) + k // 32 * 34
        q = tl.load(w_ptr + blk + 2 + k % 32, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * _half(w_ptr, blk, ok)
    elif FMT == _Q4_0:
        blk = n * (K // 32 * 18) + k // 32 * 18
        j = k % 32
        b = _byte(w_ptr, blk + 2 + j % 16, ok)
        q = (tl.where(j < 16, b & 15, b >> 4) - 8).to(tl.float32)
        w = _half(w_ptr, blk, ok) * q
    elif FMT == _Q4_K or FMT == _Q5_K:
        if FMT == _Q4_K:  # bytes a block, offset of the 4-bit values
            bytes_per, qs_at = 144, 16
        else:
            bytes_per, qs_at = 176, 48
        blk = n * (K // 256 * bytes_per) + k // 256 * bytes_per
        j = k % 256
        s = j // 32  # sub-block of 32
        sc, mn = _k_scale_min(w_ptr, blk, s, ok)
        b = _byte(w_ptr, blk + qs_at + (j // 64) * 32 + j % 32, ok)
        q = tl.where(s % 2 == 0, b & 15, b >> 4)
        if FMT == _Q5_K:
            q = q | (((_byte(w_ptr, blk + 16 + j % 32, ok) >> s) & 1) << 4)
        d = _half(w_ptr, blk, ok) * sc
        dm = _half(w_ptr, blk + 2, ok) * mn
        w = d * q.to(tl.float32) - dm
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
        blk = n * (K // 256 * 210) + k // 256 * 210
        j = k % 256
        g = j // 128
        ql = _byte(w_ptr, blk + g * 64 + j % 64, ok)
        ql = tl.where((j % 128) // 64 == 0, ql & 15, ql >> 4)
        qh = (_byte(w_ptr, blk + 128 + g * 32 + j % 32, ok) >> (((j % 128) // 32) * 2)) & 3
        q = ((ql | (qh << 4)) - 32).to(tl.float32)
        sc = tl.load(w_ptr + blk + 192 + j // 16, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_half(w_ptr, blk + 208, ok) * sc) * q
    return tl.where(ok, w, 0.0)
