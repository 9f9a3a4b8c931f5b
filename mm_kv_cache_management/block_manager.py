"""``BlockManager``: allocation of fixed-size KV blocks to requests, in three rooms.

Which block of KV memory holds which token of which request, as vLLM v1's ``KVCacheManager``
over its block pool. The class is assembled from one mixin per concern, each in its file:

- ``block_pool.py`` (``BlockPoolMixin``): blocks, reference counts, the LRU free queue and
  the prefix cache (chained block hashes; a full, computed block is shared until evicted);
- ``state_slots.py`` (``StateSlotsMixin``): a hybrid model's recurrent-state slots, taken and
  freed with the blocks, and the state snapshots its prefix cache needs;
- ``tier_handoff.py`` (``TierHandoffMixin``): write-through of registered blocks to the KV
  tier below the prefix cache (disk) and loads from it past the last in-memory hit.

Here: the constructor (the state every room reads) and the request-level operations that walk
all three in order (admission, prefill and decode allocation, commit, free).
"""

from __future__ import annotations

from collections import OrderedDict

from mm_kv_cache_management.block_pool import Block, BlockPoolMixin, NoFreeBlocksError
from mm_kv_cache_management.block_table import BlockTable
from mm_kv_cache_management.request_state import RequestState
from mm_kv_cache_management.state_slots import StateSlotsMixin
from mm_kv_cache_management.tier_handoff import TierHandoffMixin

__all__ = ["Block", "BlockManager", "NoFreeBlocksError"]


class BlockManager(BlockPoolMixin, StateSlotsMixin, TierHandoffMixin):
    """Hands out KV blocks of ``block_size`` tokens to requests.

    Args:
        num_blocks: blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: share full, computed blocks between requests by content hash.
        kv_tier: None, or an object with ``save(block_hash, block_id)`` and ``load(block_hash,
            block_id) -> bool`` (``KVBlockTier``): a
            lower cache tier (disk) for registered blocks; needs prefix caching.
        state_cache: None, or the hybrid model's ``StateCache`` (its slots are handed out with
            the blocks: ``RequestState.state_slot``); prefix caching then needs ``state_snapshots``
            (else a hit would skip tokens whose recurrent state is not stored).
        state_snapshots: None, or the hybrid model's ``StateSnapshotPool`` (emptied here: a new
            block manager has an empty prefix cache).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1; a ``kv_tier`` without prefix
            caching; a ``state_cache`` with prefix caching but no ``state_snapshots``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 kv_tier=None, state_cache=None, state_snapshots=None, drop_last_hit_block: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}: the KV budget holds no block")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.drop_last_hit_block = drop_last_hit_block
        if kv_tier is not None and not enable_prefix_caching:
            raise ValueError("a KV tier (kv_cache_dir) needs prefix caching on (enable_prefix_caching=True)")
        self.kv_tier = kv_tier
        if state_cache is not None and enable_prefix_caching and state_snapshots is None:
            raise ValueError("a state cache (hybrid model) runs without prefix caching: a hit would skip "
                             "tokens whose recurrent state is not stored")
        self.state_cache = state_cache
        self.state_snapshots = state_snapshots if enable_prefix_caching else None
        if self.state_snapshots is not None:
            self.state_snapshots.clear()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    def can_allocate(self, req: RequestState) -> bool:
        """Whether ``prefill_allocate(req)`` would succeed now (blocks, and a state slot if any)."""
        if not self._has_free_slot():
            return False
        hits = self._cache_hits(req)
        fresh_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.num_blocks_needed(req.num_tokens) - len(hits)
        return needed <= self.num_free_blocks - fresh_hits

    def prefill_allocate(self, req: RequestState) -> BlockTable:
        """Reserve blocks for all of ``req.token_ids``: ceil(len / block_size) blocks.

        With prefix caching, the longest cached prefix is shared (reference count + 1) and
        ``req.num_computed_tokens`` / ``req.num_cached_tokens`` start past it; with a KV
        tier, past the blocks then loaded from it too. With a state cache the request also
        takes a zeroed slot (``req.state_slot``).

        Raises:
            ValueError: the request already holds blocks.
            NoFreeBlocksError: not enough free blocks or no free state slot; nothing is allocated.
        """
        if req.block_table is not None:
            raise ValueError(f"request {req.request_id!r} already holds blocks")
        if not self.can_allocate(req):
            raise NoFreeBlocksError(
                f"request {req.request_id!r} needs {self.num_blocks_needed(req.num_tokens)} blocks "
                f"for {req.num_tokens} tokens, only {self.num_free_blocks} free"
                + self._slot_text()
            )
        self._take_slot(req)
        hits = self._cache_hits(req)
        for block_id in hits:
            self._touch(block_id)
        fresh = [self._take_free_block() for _ in range(self.num_blocks_needed(req.num_tokens) - len(hits))]
        num_hits = len(hits) + self._load_from_tier(req, len(hits), fresh)
        self._restore_state(req, num_hits)  # a hybrid's hit ends at a snapshot: its state, restored
        num_cached = num_hits * self.block_size
        req.block_table = BlockTable(self.block_size, hits + fresh, num_tokens=num_cached)
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        return req.block_table

    def decode_append(self, req: RequestState) -> int:
        """Reserve the slot of the newest token ``req.token_ids[-1]`` and return it.

        A new block is taken only when the held blocks are full (a block boundary).

        Raises:
            ValueError: the request holds no blocks.
            NoFreeBlocksError: a new block is needed and none is free; nothing changes.
        """
        table = req.block_table
        if table is None:
            raise ValueError(f"request {req.request_id!r} holds no blocks; prefill_allocate first")
        pos = req.num_tokens - 1
        # Blocks missing to reach ``pos``: 1 at a boundary of a one-token step, 0 otherwise; more
        # only if several tokens were appended since the last call. Checked before any change.
        missing = self.num_blocks_needed(pos + 1) - len(table.block_ids)
        if missing > 0:
            if missing > len(self._free):
                raise NoFreeBlocksError(
                    f"no free block for token {pos} of request {req.request_id!r}: "
                    f"needs {missing}, {len(self._free)} free"
                )
            table.block_ids.extend(self._take_free_block() for _ in range(missing))
        table.num_tokens = max(table.num_tokens, pos + 1)
        return table.slot(pos)

    def commit_computed(self, req: RequestState, num_new_tokens: int) -> None:
        """Record that the K/V of ``req``'s next ``num_new_tokens`` tokens are now stored:
        advances ``num_computed_tokens`` and ``block_table.num_tokens`` and registers the full
        blocks in the prefix cache. The only writer of a request's progress after a forward.

        Raises:
            ValueError: no blocks held, ``num_new_tokens < 0``, or the tokens would pass the
                request's tokens or its reserved slots.
        """
        table = req.block_table
        if table is None:
            raise ValueError(f"request {req.request_id!r} holds no blocks; nothing can be computed")
        end = req.num_computed_tokens + num_new_tokens
        if num_new_tokens < 0 or end > req.num_tokens or end > table.capacity:
            raise ValueError(
                f"request {req.request_id!r}: cannot commit {num_new_tokens} tokens after "
                f"{req.num_computed_tokens} ({req.num_tokens} tokens, {table.capacity} slots reserved)"
            )
        req.num_computed_tokens = end
        table.num_tokens = max(table.num_tokens, end)
        self.cache_full_blocks(req)
        self._commit_snapshots(req)  # the chunk's snapshots are written: valid once registered

    def free_request(self, req: RequestState) -> None:
        """Give back every block of ``req`` (tail first, so the LRU evicts tails first) and its
        state slot, if any. Idempotent."""
        self._free_slot(req)
        table = req.block_table
        if table is None:
            return
        for block_id in reversed(table.block_ids):
            self._release(block_id)
        req.block_table = None
        req.num_computed_tokens = 0
