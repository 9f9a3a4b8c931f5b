"""The block pool of ``BlockManager``: KV blocks, their reference counts, the LRU free queue and
the prefix cache.

Modelled on vLLM v1's block pool: every block has a reference count; blocks with count 0 sit
in an LRU free queue (oldest freed is reused first); with prefix caching on, a full block
whose K/V are computed is registered under its chained hash and can be shared by later
requests until it is evicted from the free queue. ``BlockPoolMixin`` holds these operations;
``BlockManager`` (``block_manager.py``) sets the state they read in its ``__init__``:
``blocks``, ``_free``, ``_cached``, ``block_size``, ``enable_prefix_caching`` and the hooks of
the other two rooms (``state_snapshots``: ``state_slots.py``; the tier's write-through:
``tier_handoff.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_kv_cache_management.request_state import RequestState

__all__ = ["Block", "BlockPoolMixin", "NoFreeBlocksError"]


class NoFreeBlocksError(RuntimeError):
    """Raised when a request needs more KV blocks than are free; nothing was allocated."""


@dataclass(slots=True)
class Block:
    block_id: int  # index of this block in the KV cache tensors
    ref_count: int = 0  # live block tables holding this block
    block_hash: bytes | None = None  # chained content hash while registered in the prefix cache


class BlockPoolMixin:
    """Blocks and the prefix cache (see the module docstring); mixed into ``BlockManager``."""

    #: drop the last block of every prefix hit, so it is recomputed (vLLM's ``use_eagle``): set for
    #: a drafter whose K/V at a block's last position depend on the token after the block (MTP)
    drop_last_hit_block: bool = False

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0 (cached-but-free blocks included)."""
        return len(self._free)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------
    def _cache_hits(self, req: RequestState) -> list[int]:
        """Block ids of the longest cached prefix; never covers the last prompt token (C11).
        With ``drop_last_hit_block``: without its last block. With state snapshots: the longest
        that ends at a block with a snapshot (maybe none)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        hashes = req.block_hashes(self.block_size, req.num_tokens - 1)
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if self.drop_last_hit_block and hits:
            hits.pop()
        return self._hits_ending_at_snapshots(hits, hashes)

    def cache_full_blocks(self, req: RequestState) -> None:
        """Register the request's full blocks whose K/V are computed under their hashes (and
        write each newly registered one through to the KV tier, if any)."""
        if not self.enable_prefix_caching or req.block_table is None:
            return
        hashes = req.block_hashes(self.block_size, req.num_computed_tokens)
        for block_id, h in zip(req.block_table.block_ids, hashes):
            block = self.blocks[block_id]
            if block.block_hash is None and h not in self._cached:
                self._register(block_id, h)
                self._save_to_tier(h, block_id)

    def _register(self, block_id: int, block_hash: bytes) -> None:
        self.blocks[block_id].block_hash = block_hash
        self._cached[block_hash] = block_id

    # ---- allocation ---------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            del self._cached[block.block_hash]
            self._drop_snapshot(block.block_hash)  # a snapshot never outlives its block hash
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        """One holder fewer; at 0 the block joins the free queue's tail (still cached)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def free_uncomputed_tail(self, req: RequestState) -> int:
        """Give back the slots reserved past ``req.num_computed_tokens`` (speculative drafts
        that were rejected): ``block_table.num_tokens`` falls back to the computed tokens and
        every tail block left without a computed token is freed. Nothing is registered in the
        prefix cache (only ``commit_computed`` registers, and only computed tokens). Returns
        the blocks freed.

        Raises:
            ValueError: the request holds no blocks.
        """
        table = req.block_table
        if table is None:
            raise ValueError(f"request {req.request_id!r} holds no blocks; nothing to give back")
        keep = self.num_blocks_needed(req.num_computed_tokens)
        freed = 0
        while len(table.block_ids) > keep:
            self._release(table.block_ids.pop())
            freed += 1
        table.num_tokens = min(table.num_tokens, req.num_computed_tokens)
        return freed
