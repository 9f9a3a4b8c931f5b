"""The ``"triton"`` attention backend as ``layers.attention.paged_attention`` calls it: the
step's new K/V written by the Triton KV write (``triton_cache``; an 8-bit cache by
``triton_kv8``), then attended by the unified kernel (``triton_attention``) from the blocks.

An 8-bit cache holds ``K H`` and ``V H`` (``kv_quant``: ``H`` the Hadamard rotation,
symmetric and its own inverse). The reference backend rotates them back on read; here, as in
the C decode kernel, q is rotated once instead (``q.k = (q H).(k H)``) and the output once
(``sum p v = (sum p (v H)) H``), in fp32, so the kernel reads the codes as stored.
"""

from __future__ import annotations

import torch

from atlas_vlm.kernels.triton_attention import TritonLayout, unified_attention
from atlas_vlm.kernels.triton_cache import reshape_and_cache
from atlas_vlm.kernels.triton_kv8 import reshape_and_cache_kv8
from mm_kv_cache_management.kv_quant import hadamard_rotate


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache, layer: int,
                           layout: TritonLayout, slot_mapping: torch.Tensor, query_index: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """``layers.attention.paged_attention`` for the ``"triton"`` backend: write the new K/V
    (``triton_cache.reshape_and_cache``; 8-bit: ``triton_kv8.reshape_and_cache_kv8``), then
    attend from the blocks (8-bit: q rotated in, the output rotated back, as the C decode kernel).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``
            or None (already in the cache).
        kv_cache: a ``PagedKVCache`` / ``ContiguousKVCache`` (model dtype or 8-bit), or None for a
            cache-free full prefill (k / v then serve as a cache of one-token blocks, read
            through ``query_index``: ``[num_seqs, max_query_len]`` flat token of each row).
        slot_mapping: ``[num_tokens]`` cache slots of the new tokens.

    Returns:
        ``[num_tokens, num_heads, head_dim]``.

    Raises:
        ValueError: k / v missing without a cache.
    """
    if kv_cache is None:
        if k is None or layout.query_lens != layout.seq_lens.tolist():
            raise ValueError("without a KV cache the triton backend needs k / v and full prefills only")
        # [num_tokens, kvh, hd] -> [num_tokens, 1, kvh, hd]: token t is block t of one row
        one_token_blocks = TritonLayout(layout.query_lens, layout.query_start, layout.seq_lens, query_index,
                                        layout._q_blocks)
        return unified_attention(q, k.unsqueeze(1).to(q.dtype), v.unsqueeze(1).to(q.dtype), one_token_blocks, scale)
    k_cache, v_cache, k_scale, v_scale = kv_cache.layer_kv(layer)
    if k_scale is None:
        if k is not None:
            reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        return unified_attention(q, k_cache, v_cache, layout, scale)
    kv_dtype = kv_cache.spec.kv_cache_dtype
    if k is not None:
        reshape_and_cache_kv8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, kv_dtype)
    # the codes hold K H and V H (H the Hadamard rotation, symmetric, its own inverse):
    # q.k = (q H).(k H) and sum p v = (sum p (v H)) H, so q is rotated in and the output back out
    q_rot = hadamard_rotate(q).to(q.dtype)  # [num_tokens, num_heads, head_dim]
    out = unified_attention(q_rot, k_cache, v_cache, layout, scale, k_scale, v_scale, kv_dtype, torch.float32)
    return hadamard_rotate(out).to(q.dtype)
