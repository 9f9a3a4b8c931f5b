"""KV storage: the paged cache and the contiguous reference it is aligned to.

Both expose the same surface, used by ``atlas_vlm``'s single ``paged_attention`` function:
``write(layer, slot_mapping, k, v)`` stores new tokens' K/V through flat slots, and
``gather_kv_for_attention(layer, block_tables, max_len)`` returns each request's K/V as one
padded tensor for SDPA with a length mask. With ``KVCacheSpec.kv_cache_dtype`` "int8" /
"fp8_e4m3" both store 8-bit codes plus one float16 scale per (token, KV head) (``kv_quant``):
``write`` quantizes, ``gather_kv_for_attention`` returns values in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_kv_cache_management.block_table import BlockTable
from mm_kv_cache_management.kv_quant import (SCALE_DTYPE, STORAGE_DTYPES, check_kv_cache_dtype,
                                             dequantize_per_token_head, quantize_per_token_head)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the K/V one token leaves in every layer."""

    num_layers: int  # decoder layers
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # channels per head
    dtype: torch.dtype  # the model's dtype: what attention reads (and stores, with kv_cache_dtype "auto")
    kv_cache_dtype: str = "auto"  # "auto" | "int8" | "fp8_e4m3" (kv_quant: 8-bit codes + per-token-head scales)

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of ``k_cache`` / ``v_cache``."""
        return STORAGE_DTYPES[self.kv_cache_dtype] if self.quantized else self.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers (8-bit codes: plus their scales)."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        per_head = self.head_dim * elem + (SCALE_DTYPE.itemsize if self.quantized else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head


def _as_block_table_tensor(block_tables, device) -> torch.Tensor:
    """``BlockTable`` | list[BlockTable] | [num_seqs, max_blocks] tensor -> int64 tensor (pad 0)."""
    if isinstance(block_tables, torch.Tensor):
        return block_tables.to(device=device, dtype=torch.long)
    if isinstance(block_tables, BlockTable):
        block_tables = [block_tables]
    width = max(len(t.block_ids) for t in block_tables)
    rows = [t.block_ids + [0] * (width - len(t.block_ids)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.long, device=device)


class PagedKVCache:
    """K/V of every layer in fixed-size blocks.

    ``k_cache``, ``v_cache``: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``
    in ``spec.storage_dtype``; with 8-bit storage also ``k_scale``, ``v_scale``:
    ``[num_layers, num_blocks, block_size, num_kv_heads]`` float16 (else None).
    Token ``t`` of a request is stored at flat slot ``block_table.slot(t)``.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int = 16, device="cpu"):
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache needs at least one block of {block_size} tokens "
                f"({spec.bytes_per_token * block_size} bytes); got num_blocks={num_blocks}"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.k_cache = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
        self.k_scale = self.v_scale = None
        if spec.quantized:
            self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)

    @classmethod
    def num_blocks_for_budget(cls, budget_bytes: int, spec: KVCacheSpec, block_size: int = 16) -> int:
        """Whole blocks that fit in ``budget_bytes`` (K and V of all layers)."""
        return int(budget_bytes) // (spec.bytes_per_token * block_size)

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the K and V tensors (and their scales)."""
        scales = 0 if self.k_scale is None else 2 * self.k_scale.numel() * self.k_scale.element_size()
        return 2 * self.k_cache.numel() * self.k_cache.element_size() + scales

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens.

        Args:
            slot_mapping: ``[num_tokens]`` int64 flat slots.
            k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        """
        kvh, hd = self.spec.num_kv_heads, self.spec.head_dim
        if self.spec.quantized:  # K and V in one call: [2, T, kvh, hd] codes, [2, T, kvh] scales
            q, s = quantize_per_token_head(torch.stack([k, v.to(k.dtype)]), self.spec.kv_cache_dtype)
            for i, (codes, scales) in enumerate(((self.k_cache, self.k_scale), (self.v_cache, self.v_scale))):
                codes[layer].view(-1, kvh, hd).index_copy_(0, slot_mapping, q[i])
                scales[layer].view(-1, kvh).index_copy_(0, slot_mapping, s[i])
            return
        self.k_cache[layer].view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(self.spec.dtype))
        self.v_cache[layer].view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(self.spec.dtype))

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One layer's stored ``(k, v, k_scale, v_scale)`` as kernels read them: codes / values
        ``[num_blocks, block_size, kv_heads, head_dim]``, scales ``[num_blocks, block_size,
        kv_heads]`` (None without 8-bit storage)."""
        if self.k_scale is None:
            return self.k_cache[layer], self.v_cache[layer], None, None
        return self.k_cache[layer], self.v_cache[layer], self.k_scale[layer], self.v_scale[layer]

    def _values(self, codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """Stored rows ``[..., kv_heads, head_dim]`` (and their scales) -> the model dtype."""
        if scales is None:
            return codes
        return dequantize_per_token_head(codes, scales, self.spec.kv_cache_dtype, self.spec.dtype)

    def gather_kv_for_attention(self, layer: int, block_tables, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's K/V as one padded tensor.

        Args:
            block_tables: a ``BlockTable``, a list of them, or ``[num_seqs, max_blocks]`` int
                tensor (padding entries may hold any valid block id).
            max_len: tokens to return per request (the longest context); positions past a
                request's own length hold unrelated data and must be masked.

        Returns:
            k, v: ``[num_seqs, max_len, num_kv_heads, head_dim]``.
        """
        tables = _as_block_table_tensor(block_tables, self.k_cache.device)
        num_seqs = tables.shape[0]
        kvh, hd = self.spec.num_kv_heads, self.spec.head_dim
        flat = tables.view(-1)  # index_select: advanced indexing is ~100x slower on CPU
        # [num_seqs * max_blocks, block_size, kv_heads, head_dim] -> [num_seqs, max_blocks * block_size, ...]
        k = self.k_cache[layer].index_select(0, flat).view(num_seqs, -1, kvh, hd)[:, :max_len]
        v = self.v_cache[layer].index_select(0, flat).view(num_seqs, -1, kvh, hd)[:, :max_len]
        if self.spec.quantized:  # scales: [num_seqs, max_len, kv_heads]
            k = self._values(k, self.k_scale[layer].index_select(0, flat).view(num_seqs, -1, kvh)[:, :max_len])
            v = self._values(v, self.v_scale[layer].index_select(0, flat).view(num_seqs, -1, kvh)[:, :max_len])
        return k, v


class ContiguousKVCache(PagedKVCache):
    """One preallocated ``[max_model_len]`` strip of K/V per request slot.

    The reference layout the paged cache is checked against: the same ``write`` surface
    with strips in place of blocks (a strip is one "block" of ``max_model_len`` tokens, so a
    request's block table holds exactly one strip id), gathered by slicing, not indexing.
    ``k_cache``, ``v_cache``: ``[num_layers, max_num_seqs, max_model_len, num_kv_heads, head_dim]``.
    """

    def __init__(self, spec: KVCacheSpec, max_num_seqs: int, max_model_len: int, device="cpu"):
        super().__init__(spec, num_blocks=max_num_seqs, block_size=max_model_len, device=device)
        self.max_model_len = max_model_len

    def gather_kv_for_attention(self, layer: int, block_tables, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of each request's strip, ``[num_seqs, max_len, num_kv_heads, head_dim]``."""
        strips = _as_block_table_tensor(block_tables, self.k_cache.device)[:, 0].tolist()
        k = torch.stack([self.k_cache[layer, s, :max_len] for s in strips])  # [num_seqs, max_len, kv_heads, head_dim]
        v = torch.stack([self.v_cache[layer, s, :max_len] for s in strips])
        if self.spec.quantized:  # scales: [num_seqs, max_len, kv_heads]
            k = self._values(k, torch.stack([self.k_scale[layer, s, :max_len] for s in strips]))
            v = self._values(v, torch.stack([self.v_scale[layer, s, :max_len] for s in strips]))
        return k, v
