"""The KV write in Triton (vLLM's ``reshape_and_cache``): a step's new K/V rows into their
cache slots, for the ``"triton"`` attention backend.

One program per new token: its slot ``s`` (``slot_mapping``) names block ``s // block_size``
and row ``s % block_size``; all of the token's KV heads are copied at once (head counts and
head dims padded to powers of two with masks), in the cache dtype. A negative slot
(vLLM's padding convention) writes nothing. The same values as ``PagedKVCache.write``
(``index_copy_``) for a cache in the model dtype; 8-bit caches: ``triton_kv8``.
Runs on CPU tensors under ``TRITON_INTERPRET=1`` (``tests/triton_kernels/``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size, stride_kt, stride_kh,
                              stride_vt, stride_vh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
                              stride_vch, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        row = slot % block_size
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        ok = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [HEADS_PAD, HEAD_DIM_PAD]
        k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=ok)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=ok)
        tl.store(k_cache_ptr + blk * stride_kcb + row * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
                 k, mask=ok)
        tl.store(v_cache_ptr + blk * stride_vcb + row * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
                 v, mask=ok)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write new K/V into one layer's blocks, in place.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in a float dtype
            (k / v are cast to it first).
        slot_mapping: ``[num_tokens]`` int flat slots (``block * block_size + row``); < 0: skip.

    Raises:
        ValueError: shapes disagree (named).
    """
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    num_tokens, kv_heads, head_dim = k.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(f"k_cache / v_cache must be [num_blocks, block_size, {kv_heads}, {head_dim}], got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    # cast on the host (a no-op in the engine: K/V come in the cache dtype): torch rounds to
    # nearest even, the interpreter's fp32 -> bf16 cast does not
    k, v = k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype).contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous along head_dim")
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1], k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim))
