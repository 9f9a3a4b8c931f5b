"""Quantized-weight matmuls in Triton: ``y = x @ W.T`` straight from the stored bytes, the
weight dequantized in registers (``triton_quant_formats``), never materialized in memory.

Two kernels, one per regime (as vLLM's and llama.cpp's GPU paths split them):

- ``_gemv_kernel`` (decode, ``M <= GEMV_MAX_ROWS`` rows): split-K. Program ``(j, s)`` takes
  ``BLOCK_N`` output rows and the ``s``-th of ``split_k`` slices of K, multiplies in fp32
  without ``tl.dot`` (a broadcast multiply and row sums: M is too small for tensor cores) and
  writes fp32 partial sums ``[split_k, M, N]`` that one ``sum`` reduces (deterministic: no
  atomics). With ``split_k == 1`` it writes the output itself, bias added.
- ``_gemm_kernel`` (prefill): ``BLOCK_M x BLOCK_N`` output tiles, ``tl.dot`` over
  ``BLOCK_K`` slices, the dequantized tile rounded to x's dtype first (what the reference
  ``F.linear`` over a weight dequantized to x's dtype multiplies); fp32 in IEEE fp32 (no TF32).

Formats: ``Int8Linear`` / ``Int4Linear`` tiles (:func:`quant_linear_triton`) and GGUF blocks
as stored (:func:`gguf_matmul_triton`: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K; its reference
:func:`gguf_matmul_reference` is gguf-py's ``dequantize`` and ``F.linear``). On CPU tensors
the kernels run under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported), as CI tests
them (``tests/triton_kernels/``); under the interpreter bf16 multiplies in fp32 (its ``tl.dot``
reads bf16's raw bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atlas_vlm.kernels.triton_quant_formats import GGUF_BLOCK, INT4, INT8, INT8_MIN, dequant

GEMV_MAX_ROWS = 8  # decode rows through the split-K GEMV; more through the tiled GEMM
GEMV_BLOCK_N, GEMV_BLOCK_K = 32, 64
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_BLOCK_K = 16, 32, 32
TARGET_PROGRAMS = 264  # split-K fills about two waves of an H100's 132 SMs


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, m_ptr, bias_ptr, out_ptr, M, N, K, group, k_per_split, stride_xm,
                 stride_os, stride_om, FMT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = dequant(FMT, w_ptr, s_ptr, m_ptr, offs_n[:, None], k[None, :], n_ok[:, None] & k_ok[None, :], K,
                    group)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, m_ptr, bias_ptr, out_ptr, M, N, K, group, stride_xm, stride_om,
                 FMT: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = dequant(FMT, w_ptr, s_ptr, m_ptr, offs_n[None, :], k[:, None], k_ok[:, None] & n_ok[None, :], K,
                    group)  # [BLOCK_K, BLOCK_N] fp32
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w.to(x_ptr.dtype.element_ty).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _split_k(n: int, k: int) -> int:
    """K slices for the GEMV: enough programs for about ``TARGET_PROGRAMS``, each slice at least
    ``4 * GEMV_BLOCK_K`` inputs."""
    n_tiles = triton.cdiv(n, GEMV_BLOCK_N)
    return max(1, min(TARGET_PROGRAMS // n_tiles, k // (4 * GEMV_BLOCK_K)))


def quant_matmul_triton(x: torch.Tensor, fmt: int, w: torch.Tensor, scales: torch.Tensor | None,
                        mins: torch.Tensor | None, n: int, k: int, group: int, bias: torch.Tensor | None = None,
                        split_k: int | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a weight stored in format ``fmt`` (``triton_quant_formats``).

    Args:
        x: ``[M, K]`` fp32 / fp16 / bf16 (made contiguous).
        w: the stored weight (tiles or GGUF blocks, contiguous); scales / mins: INT* only.
        n, k: output / input features; group: the INT* group size (ignored for GGUF).
        bias: ``[N]`` or None. split_k: GEMV K slices (default :func:`_split_k`).

    Returns:
        ``[M, N]`` in x's dtype: the split-K GEMV up to ``GEMV_MAX_ROWS`` rows, else the GEMM.

    Raises:
        ValueError: x is not ``[M, k]`` in a float dtype.
    """
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be [M, {k}] in float32 / float16 / bfloat16, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    s = scales if scales is not None else w
    mn = mins if mins is not None else s
    b = bias if bias is not None else out
    if m <= GEMV_MAX_ROWS:
        splits = split_k or _split_k(n, k)
        k_per_split = triton.cdiv(triton.cdiv(k, splits), GEMV_BLOCK_K) * GEMV_BLOCK_K
        splits = triton.cdiv(k, k_per_split)
        part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        _gemv_kernel[(triton.cdiv(n, GEMV_BLOCK_N), splits)](
            x, w, s, mn, b, part, m, n, k, group, k_per_split, x.stride(0), m * n, n, FMT=fmt,
            HAS_BIAS=bias is not None and splits == 1, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=GEMV_BLOCK_N,
            BLOCK_K=GEMV_BLOCK_K)
        if splits > 1:
            total = part.sum(0)  # [M, N] fp32
            out.copy_(total if bias is None else total + bias.float())
        return out
    grid = (triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, GEMM_BLOCK_N))
    _gemm_kernel[grid](x, w, s, mn, b, out, m, n, k, group, x.stride(0), out.stride(0), FMT=fmt,
                       HAS_BIAS=bias is not None, FP32_DOT=x.dtype == torch.float32 or
                       (x.dtype == torch.bfloat16 and interpreting()), BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N,
                       BLOCK_K=GEMM_BLOCK_K)
    return out


def quant_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                        n: int, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``Int8Linear`` / ``Int4Linear``'s matmul from their tiles (``layers/quant_format``):
    int8 when ``qweight`` is int8 (``mins`` optional), int4 when uint8 (``mins`` required).
    ``x`` ``[M, K]`` -> ``[M, n]`` in x's dtype.

    Raises:
        ValueError: int4 without mins, or a qweight of another dtype.
    """
    k = x.shape[-1]
    if qweight.dtype == torch.int8:
        fmt = INT8 if mins is None else INT8_MIN
    elif qweight.dtype == torch.uint8 and mins is not None:
        fmt = INT4
    else:
        raise ValueError(f"qweight must be int8 (Int8Linear) or uint8 with mins (Int4Linear), got {qweight.dtype}")
    return quant_matmul_triton(x, fmt, qweight, scales, mins, n, k, group_size, bias)


def _gguf_rows(blocks: torch.Tensor, qtype, n: int, k: int) -> tuple[int, torch.Tensor]:
    """``(qtype id, blocks as contiguous uint8)`` after checking that they hold ``[n, k]``."""
    q = int(qtype)
    if q not in GGUF_BLOCK:
        raise ValueError(f"qtype {qtype!r} is not one of Q4_0, Q8_0, Q4_K, Q5_K, Q6_K")
    values, nbytes = GGUF_BLOCK[q]
    if k % values:
        raise ValueError(f"K={k} is not a multiple of the {values}-value blocks of qtype {qtype!r}")
    if blocks.dtype != torch.uint8 or blocks.numel() != n * (k // values) * nbytes:
        raise ValueError(f"blocks must be uint8 holding {n * (k // values) * nbytes} bytes for [{n}, {k}] in qtype "
                         f"{qtype!r}, got {blocks.dtype} with {blocks.numel()} elements")
    return q, blocks.contiguous()


def gguf_matmul_triton(x: torch.Tensor, blocks: torch.Tensor, qtype, N: int, K: int) -> torch.Tensor:  # noqa: N803
    """``x @ W.T`` with ``W`` ``[N, K]`` in GGUF blocks as stored (rows of ``K / block``
    blocks back to back, uint8, any shape of that many bytes). ``qtype``: a
    ``gguf.GGMLQuantizationType`` (or its int). ``x`` ``[M, K]`` -> ``[M, N]`` in x's dtype.

    Raises:
        ValueError: an unsupported qtype, K not whole blocks, or blocks of the wrong size.
    """
    q, blocks = _gguf_rows(blocks, qtype, N, K)
    return quant_matmul_triton(x, q, blocks, None, None, N, K, 1)


def gguf_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, qtype, N: int, K: int) -> torch.Tensor:  # noqa: N803
    """:func:`gguf_matmul_triton`'s reference: gguf-py's ``dequantize`` (fp32) to ``[N, K]``,
    then ``F.linear`` in x's dtype."""
    from gguf import GGMLQuantizationType, quants

    _, blocks = _gguf_rows(blocks, qtype, N, K)
    w = quants.dequantize(blocks.cpu().numpy().reshape(N, -1), GGMLQuantizationType(int(qtype)))  # [N, K] fp32
    return F.linear(x, torch.from_numpy(w).to(device=x.device, dtype=x.dtype))
