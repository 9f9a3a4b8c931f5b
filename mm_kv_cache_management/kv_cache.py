"""KV storage: the paged cache and the contiguous reference it is aligned to.

Both expose the same surface, used by ``atlas_vlm``'s single ``paged_attention`` function:
``write(layer, slot_mapping, k, v)`` stores new tokens' K/V through flat slots, and
``gather_kv_for_attention(layer, block_tables, max_len)`` returns each request's K/V as one
padded tensor for SDPA with a length mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mm_kv_cache_management.block_table import BlockTable


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the K/V one token leaves in every layer."""

    num_layers: int  # decoder layers
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # channels per head
    dtype: torch.dtype  # storage dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


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

    ``k_cache``, ``v_cache``: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
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
        self.k_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=spec.dtype, device=device)

    @classmethod
    def num_blocks_for_budget(cls, budget_bytes: int, spec: KVCacheSpec, block_size: int = 16) -> int:
        """Whole blocks that fit in ``budget_bytes`` (K and V of all layers)."""
        return int(budget_bytes) // (spec.bytes_per_token * block_size)

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the K and V tensors."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens.

        Args:
            slot_mapping: ``[num_tokens]`` int64 flat slots.
            k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        """
        kvh, hd = self.spec.num_kv_heads, self.spec.head_dim
        self.k_cache[layer].view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(self.spec.dtype))
        self.v_cache[layer].view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(self.spec.dtype))

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
        return k, v
