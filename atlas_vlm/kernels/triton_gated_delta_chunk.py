"""Qwen3.5's Gated DeltaNet prefill in Triton: the chunked gated delta rule (WY / UT-transform
form) from an initial state to the outputs and the final state, with the signature of HF's
``torch_chunk_gated_delta_rule`` (the PyTorch path's reference).

fla's ``chunk_gated_delta_rule`` (``fla/ops/gated_delta_rule/chunk.py``, ``wy_fast.py``,
``fla/ops/common/chunk_delta_h.py``, ``chunk_o.py``) is the anchor; here its five launches
are one: a program per (sequence, value head, ``BLOCK_V`` value columns) keeps its
``[head_k_dim, BLOCK_V]`` fp32 state in registers and walks the chunks of ``BT`` tokens in
order. Per chunk, with ``G`` the in-chunk cumulative sum of the log decays ``g``:

- ``L = tril(diag(beta) K K^T * exp(G_i - G_j), -1)`` and ``A = (I + L)^-1`` by forward
  substitution row after row (fla's original ``fwd_prepare_wy_repr`` loop, HF's loop);
- ``U = A diag(beta) V``, ``W = A diag(beta exp(G)) K`` (the WY representation);
- ``V' = U - W S``; ``O = (Q exp(G)) S + (tril(Q K^T * exp(G_i - G_j))) V'``;
- ``S <- exp(G_last) S + (K exp(G_last - G))^T V'``.

Every product runs in IEEE fp32 (no TF32) on fp32 copies of the inputs, as the reference
does, so fp32 inputs agree to rounding. The tail chunk is masked (zero k / v / beta / g, as
the reference's padding). Each ``A`` is recomputed by the ``head_v_dim / BLOCK_V`` programs of
a head (cheap next to the state products at ``BLOCK_V = 64``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atlas_vlm.kernels.triton_gated_delta import unsupported_reason


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, out_ptr, ht_ptr, L, scale, stride_qb, stride_qt,
                  stride_vb, stride_vt, stride_gb, stride_gt, stride_ob, stride_ot,
                  NUM_K_HEADS: tl.constexpr, NUM_V_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr, BT: tl.constexpr, HAS_H0: tl.constexpr,
                  L2NORM: tl.constexpr):
    bsz = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (NUM_V_HEADS // NUM_K_HEADS)  # HF: q / k heads repeat_interleave'd over the value heads
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, DK_PAD)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < DK, offs_v < DV
    tile = (bsz * NUM_V_HEADS + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]  # [DK_PAD, BLOCK_V]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_H0:
        s = tl.load(h0_ptr + tile, mask=tile_ok, other=0.0)
    else:
        s = tl.zeros([DK_PAD, BLOCK_V], dtype=tl.float32)
    lower = offs_t[:, None] > offs_t[None, :]  # [BT, BT] strictly lower
    causal = offs_t[:, None] >= offs_t[None, :]
    eye = (offs_t[:, None] == offs_t[None, :]).to(tl.float32)
    for start in range(0, L, BT):
        tok = start + offs_t
        t_ok = tok < L
        qk_ok = t_ok[:, None] & k_ok[None, :]
        q = tl.load(q_ptr + bsz * stride_qb + tok[:, None] * stride_qt + hk * DK + offs_k[None, :], mask=qk_ok,
                    other=0.0).to(tl.float32)  # [BT, DK_PAD]
        k = tl.load(k_ptr + bsz * stride_qb + tok[:, None] * stride_qt + hk * DK + offs_k[None, :], mask=qk_ok,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + bsz * stride_vb + tok[:, None] * stride_vt + h * DV + offs_v[None, :],
                    mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)  # [BT, BLOCK_V]
        g = tl.load(g_ptr + bsz * stride_gb + tok * stride_gt + h, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + bsz * stride_gb + tok * stride_gt + h, mask=t_ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        q = q * scale
        gc = tl.cumsum(g, axis=0)  # [BT]; padded rows add 0, so gc[BT - 1] is the last real token's
        g_last = tl.sum(tl.where(offs_t == BT - 1, gc, 0.0))
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT]
        kb = k * beta[:, None]
        a = -tl.where(lower, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
        for i in range(1, BT):  # forward substitution: row i of (I + L)^-1 from rows < i
            row_i = offs_t == i
            r = tl.sum(tl.where(row_i[:, None], a, 0.0), axis=0)  # [BT]
            r = r + tl.sum(r[:, None] * a, axis=0) * (offs_t < i)
            a = tl.where(row_i[:, None], r[None, :], a)
        a = a + eye
        u = tl.dot(a, v * beta[:, None], input_precision="ieee")  # [BT, BLOCK_V]
        w = tl.dot(a, kb * tl.exp(gc)[:, None], input_precision="ieee")  # [BT, DK_PAD]
        v_new = u - tl.dot(w, s, input_precision="ieee")
        attn = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = tl.dot(q * tl.exp(gc)[:, None], s, input_precision="ieee") + tl.dot(attn, v_new, input_precision="ieee")
        tl.store(out_ptr + bsz * stride_ob + tok[:, None] * stride_ot + h * DV + offs_v[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])
        k_decayed = k * tl.exp(g_last - gc)[:, None]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision="ieee")
    tl.store(ht_ptr + tile, s, mask=tile_ok)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's ``torch_chunk_gated_delta_rule`` in Triton: same arguments and answer.

    Args:
        query, key: ``[batch, seq_len, num_k_heads, head_k_dim]``.
        value: ``[batch, seq_len, num_v_heads, head_v_dim]`` (``num_v_heads`` a multiple of
            ``num_k_heads``; value head ``h`` reads q / k head ``h // (num_v_heads // num_k_heads)``).
        g, beta: ``[batch, seq_len, num_v_heads]`` (log decays <= 0, write strengths).
        chunk_size: tokens per chunk, a power of two in 16 .. 64.
        initial_state: ``[batch, num_v_heads, head_k_dim, head_v_dim]`` or None (zero).
        output_final_state: return the final state too.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) first.

    Returns:
        ``(out [batch, seq_len, num_v_heads, head_v_dim] in query's dtype, final state
        [batch, num_v_heads, head_k_dim, head_v_dim] fp32 or None)``.

    Raises:
        ValueError: a shape disagrees, ``chunk_size`` is not 16 / 32 / 64, or the kernel
            cannot serve (``unsupported_reason``).
    """
    bsz, seq_len, num_k_heads, head_k_dim = key.shape
    num_v_heads, head_v_dim = value.shape[-2:]
    if query.shape != key.shape or value.shape[:2] != (bsz, seq_len) or num_v_heads % num_k_heads:
        raise ValueError(f"chunk_gated_delta_rule: query / key {tuple(query.shape)} / {tuple(key.shape)} must be "
                         f"equal and value {tuple(value.shape)} [batch, seq_len, a multiple of their heads, dv]")
    if g.shape != (bsz, seq_len, num_v_heads) or beta.shape != g.shape:
        raise ValueError(f"chunk_gated_delta_rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be "
                         f"{(bsz, seq_len, num_v_heads)}")
    state_shape = (bsz, num_v_heads, head_k_dim, head_v_dim)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"chunk_gated_delta_rule: initial_state {tuple(initial_state.shape)}, expected {state_shape}")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_gated_delta_rule: chunk_size must be 16, 32 or 64, got {chunk_size}")
    why = unsupported_reason(query.device, query.dtype, head_k_dim, head_v_dim)
    if why is not None:
        raise ValueError(f"chunk_gated_delta_rule cannot serve: {why}")
    # [batch, seq_len, heads, dim] -> contiguous, so a token's heads are one row of heads * dim
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(bsz, seq_len, num_v_heads, head_v_dim, dtype=query.dtype, device=query.device)
    final = torch.empty(state_shape, dtype=torch.float32, device=query.device)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    block_v = min(64, max(16, triton.next_power_of_2(head_v_dim)))
    chunk = max(16, min(chunk_size, triton.next_power_of_2(seq_len)))  # a shorter sequence is one chunk either way
    if bsz and num_v_heads:
        _chunk_kernel[(bsz, num_v_heads, triton.cdiv(head_v_dim, block_v))](
            query, key, value, g, beta, final if h0 is None else h0, out, final, seq_len, head_k_dim ** -0.5,
            query.stride(0), query.stride(1), value.stride(0), value.stride(1), g.stride(0), g.stride(1),
            out.stride(0), out.stride(1), NUM_K_HEADS=num_k_heads, NUM_V_HEADS=num_v_heads, DK=head_k_dim,
            DV=head_v_dim, DK_PAD=max(16, triton.next_power_of_2(head_k_dim)), BLOCK_V=block_v, BT=chunk,
            HAS_H0=h0 is not None, L2NORM=use_qk_l2norm_in_kernel)
    return out, final if output_final_state else None
