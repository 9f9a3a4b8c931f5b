"""8-bit KV in Triton: the codes' encoding and decoding as ``@triton.jit`` helpers, and the
8-bit KV write (vLLM's ``reshape_and_cache`` with ``int8_per_token_head`` /
``fp8_per_token_head``) for the ``"triton"`` attention backend.

The stored format is ``mm_kv_cache_management.kv_quant``'s, bit for bit: each new K (and V)
row of one KV head is rotated (``hadamard_rotate``, on the host, the very call
``PagedKVCache.write`` makes, so the rotated rows are the same bits), then in the kernel
scaled by ``amax / QMAX`` rounded to float16 and coded: int8 rounds half to even and clamps
to [-127, 127]; fp8_e4m3 clamps to [-448, 448] and rounds to nearest even. Every step is an
exactly rounded IEEE operation (``div_rn``; the fp8 code and the rounding built from integer
and fp32 arithmetic, not from a cast: Triton's interpreter casts to fp8 without carrying a
rounded-up mantissa, and GPUs before sm_89 have no fp8 cast), so the kernel writes what the
reference writes on CPU and on CUDA. Reading (``dequantize``) gives ``code * scale`` in fp32,
exact (at most 8 + 11 significant bits), in the rotated basis: the attention kernel attends
with q rotated (``q.k = (qH).(kH)``) and rotates its output back (``kernels.triton_attention``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mm_kv_cache_management.kv_quant import QMAX, SCALE_DTYPE, STORAGE_DTYPES, hadamard_rotate

KV_QUANT = {"auto": 0, "int8": 1, "fp8_e4m3": 2}  # the kernels' KV_QUANT constexpr
_SCALE_MIN, _SCALE_MAX = tl.constexpr(2.0 ** -14), tl.constexpr(65504.0)  # as kv_quant clamps
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds |x| < 2**22 to an integer, half to even


@triton.jit
def _pow2(e):
    """2.0 ** e in fp32 for an int32 tensor ``e`` in [-126, 127], exact (built from its bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8e4m3_decode(code):
    """uint8 float8 e4m3fn codes -> their fp32 values (any GPU: no fp8 type needed)."""
    c = code.to(tl.int32)
    exp = (c >> 3) & 15
    mant = (c & 7).to(tl.float32)
    mag = tl.where(exp == 0, mant, mant + 8.0) * _pow2(tl.maximum(exp, 1) - 10)  # subnormal: mant * 2**-9
    return tl.where(c >= 128, -mag, mag)


@triton.jit
def fp8e4m3_encode(y):
    """fp32 ``y`` in [-448, 448] -> float8 e4m3fn codes (uint8), rounded to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 255) - 127, -6)  # binade; below 2**-6: the subnormal step 2**-9
    m = tl.abs(y) * _pow2(3 - exp)  # [0, 16): exact (a power of two)
    m = (m + 8388608.0) - 8388608.0  # 2**23: rounds m >= 0 to an integer, half to even
    code = (exp + 6) * 8 + m.to(tl.int32)  # a mantissa rounded up to 16 carries into the exponent
    return (code | ((bits >> 24) & 128)).to(tl.uint8)  # the sign bit (-0.0 too, as torch)


@triton.jit
def dequantize(codes, KV_QUANT: tl.constexpr):
    """int8 (KV_QUANT 1) / uint8 fp8 (2) codes -> fp32 values, before the scale."""
    if KV_QUANT == 2:
        return fp8e4m3_decode(codes)
    return codes.to(tl.float32)


@triton.jit
def _quantize_rows(x, qmax, inv_qmax, KV_QUANT: tl.constexpr, RECIP: tl.constexpr):
    """``[rows, head_dim]`` rotated fp32 rows (masked lanes 0) -> (codes, float16 scales
    ``[rows]``) as ``kv_quant.quantize_per_token_head``: RECIP multiplies by ``inv_qmax``
    (CUDA torch's division by a scalar) instead of dividing by ``qmax``."""
    amax = tl.max(tl.abs(x), axis=1)  # [rows]
    if RECIP:
        scale = amax * inv_qmax
    else:
        scale = tl.math.div_rn(amax, tl.zeros_like(amax) + qmax)
    scale = tl.minimum(tl.maximum(scale, _SCALE_MIN), _SCALE_MAX).to(tl.float16)  # >= 2**-14: no 0 / 0
    y = tl.math.div_rn(x, tl.broadcast_to(scale.to(tl.float32)[:, None], x.shape))
    if KV_QUANT == 1:
        y = tl.minimum(tl.maximum(y, -128.0), 128.0)  # round(clamp(y)) clamped == round(y) clamped
        codes = tl.minimum(tl.maximum((y + _RNE_MAGIC) - _RNE_MAGIC, -127.0), 127.0).to(tl.int8)
    else:
        codes = fp8e4m3_encode(tl.minimum(tl.maximum(y, -448.0), 448.0))
    return codes, scale


@triton.jit
def _reshape_and_cache_kv8_kernel(rows_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, block_size,
                                  qmax, inv_qmax, stride_rw, stride_rt, stride_rh, stride_cb, stride_cs, stride_ch,
                                  stride_sb, stride_ss, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_QUANT: tl.constexpr,
                                  RECIP: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        row = slot % block_size
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        h_ok = offs_h < NUM_KV_HEADS
        ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # [HEADS_PAD, HEAD_DIM_PAD]
        src = rows_ptr + t * stride_rt + offs_h[:, None] * stride_rh + offs_d[None, :]
        dst = blk * stride_cb + row * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        s_dst = blk * stride_sb + row * stride_ss + offs_h
        k_codes, k_scale = _quantize_rows(tl.load(src, mask=ok, other=0.0), qmax, inv_qmax, KV_QUANT, RECIP)
        tl.store(k_cache_ptr + dst, k_codes, mask=ok)
        tl.store(k_scale_ptr + s_dst, k_scale, mask=h_ok)
        v_codes, v_scale = _quantize_rows(tl.load(src + stride_rw, mask=ok, other=0.0), qmax, inv_qmax, KV_QUANT,
                                          RECIP)
        tl.store(v_cache_ptr + dst, v_codes, mask=ok)
        tl.store(v_scale_ptr + s_dst, v_scale, mask=h_ok)


def reshape_and_cache_kv8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_cache_dtype: str) -> None:
    """Write new K/V into one layer's 8-bit blocks, in place: the same codes and scales as
    ``PagedKVCache.write`` (``kv_quant.quantize_per_token_head``).

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` in any float dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` codes in
            ``kv_quant.STORAGE_DTYPES[kv_cache_dtype]`` (int8, or uint8 holding fp8 e4m3fn).
        k_scale, v_scale: ``[num_blocks, block_size, num_kv_heads]`` float16.
        slot_mapping: ``[num_tokens]`` int flat slots (``block * block_size + row``); < 0: skip.
        kv_cache_dtype: ``"int8"`` or ``"fp8_e4m3"``.

    Raises:
        ValueError: an unknown ``kv_cache_dtype``, or shapes / dtypes that disagree (named).
    """
    if kv_cache_dtype not in QMAX:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(QMAX)}, got {kv_cache_dtype!r}")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    num_tokens, kv_heads, head_dim = k.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(f"k_cache / v_cache must be [num_blocks, block_size, {kv_heads}, {head_dim}], got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    codes_dtype = STORAGE_DTYPES[kv_cache_dtype]
    if k_cache.dtype != codes_dtype or v_cache.dtype != codes_dtype:
        raise ValueError(f"{kv_cache_dtype} codes must be {codes_dtype}, got {k_cache.dtype} / {v_cache.dtype}")
    if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_scale.shape or k_scale.stride() != v_scale.stride() \
            or k_scale.dtype != SCALE_DTYPE or v_scale.dtype != SCALE_DTYPE or k_scale.stride(-1) != 1:
        raise ValueError(f"k_scale / v_scale must be {tuple(k_cache.shape[:3])} {SCALE_DTYPE} alike, got "
                         f"{tuple(k_scale.shape)} {k_scale.dtype} / {tuple(v_scale.shape)} {v_scale.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must have the same strides, contiguous along head_dim")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    rows = hadamard_rotate(torch.stack([k, v.to(k.dtype)]))  # [2, T, kvh, hd] fp32: PagedKVCache.write's call
    recip = rows.device.type == "cuda"  # CUDA torch divides by a scalar as a * fp32(1 / b)
    inv_qmax = (torch.tensor(1.0) / QMAX[kv_cache_dtype]).item()  # fp32-rounded, passed exactly
    _reshape_and_cache_kv8_kernel[(num_tokens,)](
        rows, k_cache, v_cache, k_scale, v_scale, slot_mapping, k_cache.shape[1], QMAX[kv_cache_dtype], inv_qmax,
        rows.stride(0), rows.stride(1), rows.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_QUANT=KV_QUANT[kv_cache_dtype], RECIP=recip)
