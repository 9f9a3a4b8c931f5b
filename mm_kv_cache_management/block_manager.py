"""Allocation of fixed-size KV blocks to requests: free queue, reference counts, prefix cache.

Modelled on vLLM v1's block pool: every block has a reference count; blocks with count 0 sit
in an LRU free queue (oldest freed is reused first); with prefix caching on, a full block
whose K/V are computed is registered under its chained hash and can be shared by later
requests until it is evicted from the free queue.

With a ``kv_tier`` (``KVBlockTier``: a disk tier below the prefix cache), every block is
also written there when it is registered (write-through; ``kv_tier.py`` says why), and
admission goes on past the last in-memory hit: each next block hash found in the tier is
loaded into one of the request's fresh blocks, registered, and counts as cached. Hashes are
chained, so the walk stops at the first block found in neither.

With a ``state_cache`` (``StateCache``: a hybrid model's recurrent-state slots, the second
cache group beside the blocks, as vLLM v1's ``MambaSpec`` group), a request also takes one
slot when it gets its blocks and gives it back with them: admission needs a free slot too, and
every path that frees a request's blocks (finish, abort, preemption) frees its slot.

Prefix caching for such a model needs ``state_snapshots`` (``StateSnapshotPool``: the state at
every ``interval``-th token, keyed by the hash of the block ending there): a hit then stops at
the last cached block that has a snapshot, which is copied into the request's fresh slot; the
scheduler reserves the snapshots each prefill chunk crosses (``reserve_snapshots``), which
become valid once their blocks are registered, and a block's eviction drops its snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mm_kv_cache_management.block_table import BlockTable
from mm_kv_cache_management.request_state import RequestState


class NoFreeBlocksError(RuntimeError):
    """Raised when a request needs more KV blocks than are free; nothing was allocated."""


@dataclass(slots=True)
class Block:
    block_id: int  # index of this block in the KV cache tensors
    ref_count: int = 0  # live block tables holding this block
    block_hash: bytes | None = None  # chained content hash while registered in the prefix cache


class BlockManager:
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

    #: drop the last block of every prefix hit, so it is recomputed (vLLM's ``use_eagle``): set for
    #: a drafter whose K/V at a block's last position depend on the token after the block (MTP)
    drop_last_hit_block: bool = False

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
        if self.state_snapshots is not None:
            while hits and hashes[len(hits) - 1] not in self.state_snapshots:
                hits.pop()
        return hits

    def cache_full_blocks(self, req: RequestState) -> None:
        """Register the request's full blocks whose K/V are computed under their hashes."""
        if not self.enable_prefix_caching or req.block_table is None:
            return
        hashes = req.block_hashes(self.block_size, req.num_computed_tokens)
        for block_id, h in zip(req.block_table.block_ids, hashes):
            block = self.blocks[block_id]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block_id
                if self.kv_tier is not None:
                    self.kv_tier.save(h, block_id)  # write-through (a no-op if on disk already)

    # ---- allocation ---------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            del self._cached[block.block_hash]
            if self.state_snapshots is not None:  # a snapshot never outlives its block hash
                self.state_snapshots.drop(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def can_allocate(self, req: RequestState) -> bool:
        """Whether ``prefill_allocate(req)`` would succeed now (blocks, and a state slot if any)."""
        if self.state_cache is not None and self.state_cache.num_free_slots == 0:
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
                + ("" if self.state_cache is None else f", and a state slot ({self.state_cache.num_free_slots} free)")
            )
        if self.state_cache is not None:
            req.state_slot = self.state_cache.allocate()
        hits = self._cache_hits(req)
        for block_id in hits:
            self._touch(block_id)
        fresh = [self._take_free_block() for _ in range(self.num_blocks_needed(req.num_tokens) - len(hits))]
        num_hits = len(hits) + self._load_from_tier(req, len(hits), fresh)
        if self.state_snapshots is not None:  # a hybrid's hit ends at a snapshot: its state, restored
            self.state_snapshots.queries += 1
            if num_hits:
                self.state_snapshots.hits += 1
                self.state_snapshots.restore(req.block_hashes(self.block_size)[num_hits - 1], self.state_cache,
                                             req.state_slot)
        num_cached = num_hits * self.block_size
        req.block_table = BlockTable(self.block_size, hits + fresh, num_tokens=num_cached)
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        return req.block_table

    def _load_from_tier(self, req: RequestState, first: int, fresh: list[int]) -> int:
        """Load the request's blocks ``first, first + 1, ..`` from the KV tier into ``fresh``
        (its newly taken blocks, in order) while found; returns how many were loaded. Like a
        memory hit, never the block holding the last prompt token (C11). With state snapshots
        (a hybrid model) the loaded run ends at the last block whose snapshot is in the pool or
        loads from disk into it (blocks past it are left unregistered, to be recomputed)."""
        if self.kv_tier is None:
            return 0
        hashes = req.block_hashes(self.block_size, req.num_tokens - 1)[first:]
        pool = self.state_snapshots
        if pool is not None:  # read no block past the last boundary that may have a snapshot
            while hashes and not (hashes[-1] in pool or self.kv_tier.contains_snapshot(hashes[-1])):
                hashes = hashes[:-1]
        loaded = []
        for h, block_id in zip(hashes, fresh):
            if not self.kv_tier.load(h, block_id):  # missing or invalid: a miss
                break
            loaded.append((h, block_id))
        if pool is not None:  # a hybrid hit ends at a snapshot (damaged snapshot files are misses)
            while loaded and not (loaded[-1][0] in pool or self.kv_tier.load_snapshot(loaded[-1][0])):
                loaded.pop()
        for h, block_id in loaded:
            if h not in self._cached:  # (a later block may still be cached in memory elsewhere)
                self.blocks[block_id].block_hash = h
                self._cached[h] = block_id
        return len(loaded)

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
        if self.state_snapshots is not None:  # the chunk's snapshots are written: valid once registered
            for _, _, h in req.snapshot_points:
                (self.state_snapshots.validate if h in self._cached else self.state_snapshots.discard)(h)
                if self.kv_tier is not None and h in self.state_snapshots:
                    self.kv_tier.save_snapshot(h)  # write-through, beside its block's file
            req.snapshot_points = []

    def reserve_snapshots(self, chunks) -> None:
        """Before a step's forward: for each ``(request, num_new_tokens)`` prefill chunk (two
        tokens or more), a snapshot slot for every multiple of the pool's interval in
        ``num_computed_tokens + 1 .. num_computed_tokens + num_new_tokens``, set as the request's
        ``snapshot_points`` ``[(tokens into the chunk, slot, block hash)]`` (only boundaries not
        snapshotted yet; none where the pool has no slot). A chunk that verifies speculative
        drafts (``spec_token_ids``) takes none: its rows may be rejected, and a decode never
        snapshots. Pending snapshots of an earlier step that never committed are forgotten
        first. No-op without a snapshot pool."""
        pool = self.state_snapshots
        if pool is None:
            return
        pool.discard_pending()
        for req, n in chunks:
            start, points = req.num_computed_tokens, []
            first = (start // pool.interval + 1) * pool.interval
            drafted = bool(getattr(req, "spec_token_ids", None))
            for end in range(first, start + n + 1, pool.interval) if n > 1 and not drafted else ():
                h = req.block_hashes(self.block_size, end)[-1]
                slot = pool.reserve(h)
                if slot is not None:
                    points.append((end - start, slot, h))
            req.snapshot_points = points

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
            block = self.blocks[table.block_ids.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
            freed += 1
        table.num_tokens = min(table.num_tokens, req.num_computed_tokens)
        return freed

    def accept_state_rows(self, req: RequestState, num_rows: int) -> None:
        """After ``req``'s verification step took ``num_rows`` rows (its last sampled token and
        ``num_rows - 1`` accepted drafts): its recurrent state becomes the state after them
        (``StateCache.accept_rows``). No-op without a state cache or a slot.

        Raises:
            ValueError: from ``StateCache.accept_rows`` (no rows kept, ``num_rows`` out of range).
        """
        if self.state_cache is not None and req.state_slot is not None:
            self.state_cache.accept_rows(req.state_slot, num_rows)

    def free_request(self, req: RequestState) -> None:
        """Give back every block of ``req`` (tail first, so the LRU evicts tails first) and its
        state slot, if any. Idempotent."""
        if req.state_slot is not None and self.state_cache is not None:
            self.state_cache.free(req.state_slot)
        req.state_slot = None
        table = req.block_table
        if table is None:
            return
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        req.block_table = None
        req.num_computed_tokens = 0
