"""Qwen3.5's Gated DeltaNet decode step in Triton: a batch of sequences, each with ``T >= 1``
new rows, straight on the layer's ``StateCache`` slots (the CUDA path of
``kernels.gated_delta``, which serves CPU in C).

Two launches: ``_conv_kernel`` (one program per sequence and ``BLOCK_C`` channels) runs the
depthwise causal conv1d + SiLU over the ``kernel - 1`` cached columns followed by the new rows
and shifts the conv state; ``_recurrent_kernel`` (one program per sequence, value head and
``BLOCK_V`` value columns, its ``[head_k_dim, BLOCK_V]`` fp32 state tile in registers) runs
q/k L2-norm and the gated delta rule (HF ``torch_recurrent_gated_delta_rule``; fla's
``fused_recurrent_gated_delta_rule`` is the anchor) row after row. Each slot's state is
read once and written once. With ``T = k + 1`` rows (a speculative verification: the last
sampled token and ``k`` drafts) the states after rows ``0 .. k - 1`` can also be written to
``keep`` buffers laid out as ``StateCache``'s kept rows, so rejected drafts roll back as on
the PyTorch path (``StateCache.accept_rows``).

Everything is computed in fp32 (states in fp32, as ``StateCache``); the conv output is
rounded to the input dtype as the PyTorch path does. Under ``TRITON_INTERPRET=1`` (set before
``triton`` is imported) the kernels run on CPU tensors: that is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas_vlm.kernels.gated_delta import _check


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return bool(triton.knobs.runtime.interpret)


def unsupported_reason(device: torch.device | str, dtype: torch.dtype, head_k_dim: int, head_v_dim: int) -> str | None:
    """Why these kernels (decode and ``triton_gated_delta_chunk``) cannot serve a layer here;
    None when they can: CUDA tensors, or CPU tensors under the interpreter; fp32 / fp16 /
    bf16; head dims up to 256."""
    device = torch.device(device)
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"device {device} (Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1)"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {dtype} (float32, float16 or bfloat16 only)"
    if not (1 <= head_k_dim <= 256 and 1 <= head_v_dim <= 256):
        return f"head dims {head_k_dim} / {head_v_dim} (1 .. 256 only)"
    return None


@triton.jit
def _columns(cached, new, m, ok, init, stride_qt, KERNEL: tl.constexpr):
    """X[m] as two masked loads (one of them zero): the ``KERNEL - 1`` cached columns (zero
    unless ``init``), then the new rows; the caller rounds both to the conv weight's dtype."""
    x = tl.load(cached + m, mask=ok & (m < KERNEL - 1) & init, other=0.0)
    y = tl.load(new + (m - (KERNEL - 1)) * stride_qt, mask=ok & (m >= KERNEL - 1), other=0.0)
    return x, y


@triton.jit
def _conv_kernel(qkv_ptr, w_ptr, conv_ptr, slots_ptr, init_ptr, mixed_ptr, keep_ptr, T, C, stride_qn, stride_qt,
                 stride_cs, stride_mn, stride_mt, KERNEL: tl.constexpr, KW: tl.constexpr, BLOCK_C: tl.constexpr,
                 KEEP: tl.constexpr):
    # X: the KERNEL - 1 cached columns then the T new rows; output row t = silu(sum_j w[:, j] X[t + j])
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, KW)
    c_ok = offs_c < C
    slot = tl.load(slots_ptr + n).to(tl.int64)
    init = tl.load(init_ptr + n) != 0
    wdt = w_ptr.dtype.element_ty
    taps = c_ok[:, None] & (offs_j[None, :] < KERNEL)  # [BLOCK_C, KW]
    w = tl.load(w_ptr + offs_c[:, None] * KERNEL + offs_j[None, :], mask=taps, other=0.0).to(tl.float32)
    cached = conv_ptr + slot * stride_cs + offs_c[:, None] * (KERNEL - 1)
    new = qkv_ptr + n * stride_qn + offs_c[:, None]
    for t in range(T):
        x, y = _columns(cached, new, t + offs_j[None, :], taps, init, stride_qt, KERNEL)
        acc = tl.sum(w * (x.to(wdt).to(tl.float32) + y.to(wdt).to(tl.float32)), axis=1)
        acc = acc / (1.0 + tl.exp(-acc))  # SiLU
        tl.store(mixed_ptr + n * stride_mn + t * stride_mt + offs_c, acc.to(mixed_ptr.dtype.element_ty), mask=c_ok)
    cols = c_ok[:, None] & (offs_j[None, :] < KERNEL - 1)  # the state after row r: X[r + 1 .. r + KERNEL - 1]
    if KEEP:  # after rows 0 .. T - 2, laid out [n, T - 1, C, KERNEL - 1]
        for r in range(T - 1):
            x, y = _columns(cached, new, r + 1 + offs_j[None, :], cols, init, stride_qt, KERNEL)
            tl.store(keep_ptr + ((n * (T - 1) + r) * C + offs_c[:, None]) * (KERNEL - 1) + offs_j[None, :],
                     x.to(wdt).to(tl.float32) + y.to(wdt).to(tl.float32), mask=cols)
    x, y = _columns(cached, new, T + offs_j[None, :], cols, init, stride_qt, KERNEL)
    final = x.to(wdt).to(tl.float32) + y.to(wdt).to(tl.float32)
    tl.debug_barrier()  # every read of the slot's columns is done before they are overwritten
    tl.store(cached + offs_j[None, :], final, mask=cols)


@triton.jit
def _recurrent_kernel(mixed_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, rec_ptr, slots_ptr, init_ptr, out_ptr, keep_ptr,
                      T, scale, stride_mn, stride_mt, stride_an, stride_at, stride_on, stride_ot, stride_rs,
                      NUM_K_HEADS: tl.constexpr, NUM_V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr, KEEP: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (NUM_V_HEADS // NUM_K_HEADS)  # HF: q / k heads repeat_interleave'd over the value heads
    offs_k = tl.arange(0, DK_PAD)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < DK, offs_v < DV
    tile_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + n).to(tl.int64)
    init = tl.load(init_ptr + n) != 0
    tile = (h * DK + offs_k[:, None]) * DV + offs_v[None, :]  # [DK_PAD, BLOCK_V] offsets in one slot
    s = tl.load(rec_ptr + slot * stride_rs + tile, mask=tile_ok & init, other=0.0)
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    bdt = b_ptr.dtype.element_ty
    for t in range(T):
        row = mixed_ptr + n * stride_mn + t * stride_mt
        q = tl.load(row + hk * DK + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(row + (NUM_K_HEADS + hk) * DK + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * NUM_K_HEADS * DK + h * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        x = tl.load(a_ptr + n * stride_an + t * stride_at + h).to(tl.float32) + bias
        g = neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # -exp(A_log) * softplus(a + dt_bias)
        b = tl.load(b_ptr + n * stride_an + t * stride_at + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(bdt).to(tl.float32)  # sigmoid in b's dtype, as the reference
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + n * stride_on + t * stride_ot + h * DV + offs_v, o.to(out_ptr.dtype.element_ty), mask=v_ok)
        if KEEP:
            tl.store(keep_ptr + (n * (T - 1) + t) * (NUM_V_HEADS * DK * DV) + tile, s, mask=tile_ok & (t < T - 1))
    tl.store(rec_ptr + slot * stride_rs + tile, s, mask=tile_ok)


def decode_rows(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
                has_initial_state: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                keep: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``T`` rows per sequence through a Gated DeltaNet token mixer, as ``T`` calls of
    ``gated_delta.decode_step`` would run them; the slots end at the state after all ``T``.

    Args:
        qkv: ``[n, T, conv_dim]``; b, a: ``[n, T, num_v_heads]``; the other arguments as
            ``gated_delta.decode_step`` (states fp32, on qkv's device).
        keep: None, or ``(conv [n, T - 1, conv_dim, kernel - 1], recurrent [n, T - 1,
            num_v_heads, head_k_dim, head_v_dim])`` fp32, filled with the states after rows
            ``0 .. T - 2`` (``StateCache.keep_row``'s rows of a verification step).

    Returns:
        ``[n, T, num_v_heads, head_v_dim]`` in ``qkv``'s dtype (before the gated norm).

    Raises:
        ValueError: a shape disagrees, slots repeat or fall outside the cache, states are not
            contiguous fp32 on qkv's device, or the kernels cannot serve (``unsupported_reason``).
    """
    if qkv.dim() != 3 or b.shape != a.shape or b.shape[:2] != qkv.shape[:2]:
        raise ValueError(f"triton gated delta decode: qkv must be [n, T, conv_dim] and b / a [n, T, num_v_heads], "
                         f"got {tuple(qkv.shape)}, {tuple(b.shape)}, {tuple(a.shape)}")
    n, rows, conv_dim = qkv.shape
    _check(qkv[:, 0], b[:, 0], a[:, 0], conv_weight, conv_state, recurrent_state, slots, has_initial_state,
           num_k_heads, head_k_dim, head_v_dim)
    num_v_heads, kernel = recurrent_state.shape[1], conv_weight.shape[-1]
    why = unsupported_reason(qkv.device, qkv.dtype, head_k_dim, head_v_dim)
    if why is not None:
        raise ValueError(f"triton gated delta decode cannot serve: {why}")
    for name, t in (("conv_state", conv_state), ("recurrent_state", recurrent_state)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device != qkv.device:
            raise ValueError(f"triton gated delta decode: {name} must be contiguous fp32 on {qkv.device}, got "
                             f"{t.dtype} on {t.device}")
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}")
    if keep is not None:
        want = ((n, rows - 1, conv_dim, kernel - 1), (n, rows - 1, num_v_heads, head_k_dim, head_v_dim))
        if len(keep) != 2 or any(tuple(t.shape) != w or t.dtype != torch.float32 or not t.is_contiguous()
                                 for t, w in zip(keep, want)):
            raise ValueError(f"keep must be contiguous fp32 tensors of shapes {want}")
    out = torch.empty(n, rows, num_v_heads, head_v_dim, dtype=qkv.dtype, device=qkv.device)
    if n == 0 or rows == 0:
        return out
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    b, a = b.contiguous(), a.to(b.dtype).contiguous()
    weight = conv_weight.detach().reshape(conv_dim, kernel).contiguous()
    slot_ids = slots.to(device=qkv.device, dtype=torch.int64).contiguous()
    flags = has_initial_state.to(device=qkv.device, dtype=torch.int8).contiguous()
    mixed = torch.empty(n, rows, conv_dim, dtype=qkv.dtype, device=qkv.device)  # conv + SiLU, as the reference
    keep_conv, keep_rec = keep if keep is not None else (conv_state, recurrent_state)  # unused when KEEP is off
    block_c = 128
    _conv_kernel[(n, triton.cdiv(conv_dim, block_c))](
        qkv, weight, conv_state, slot_ids, flags, mixed, keep_conv, rows, conv_dim, qkv.stride(0), qkv.stride(1),
        conv_state.stride(0), mixed.stride(0), mixed.stride(1), KERNEL=kernel, KW=triton.next_power_of_2(kernel),
        BLOCK_C=block_c, KEEP=keep is not None)
    block_v = min(64, triton.next_power_of_2(head_v_dim))
    _recurrent_kernel[(n, num_v_heads, triton.cdiv(head_v_dim, block_v))](
        mixed, a, b, A_log.detach(), dt_bias.detach(), recurrent_state, slot_ids, flags, out, keep_rec, rows,
        head_k_dim ** -0.5, mixed.stride(0), mixed.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        recurrent_state.stride(0), NUM_K_HEADS=num_k_heads, NUM_V_HEADS=num_v_heads, DK=head_k_dim, DV=head_v_dim,
        DK_PAD=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, KEEP=keep is not None)
    return out


def decode_step(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
                has_initial_state: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """``gated_delta.decode_step`` in Triton (one row per sequence, ``qkv`` ``[n, conv_dim]``):
    same arguments, answer ``[n, num_v_heads, head_v_dim]`` and in-place state update.
    Raises ValueError as ``decode_rows``."""
    return decode_rows(qkv[:, None], b[:, None], a[:, None], conv_weight, A_log, dt_bias, conv_state, recurrent_state,
                       slots, has_initial_state, num_k_heads, head_k_dim, head_v_dim)[:, 0]
