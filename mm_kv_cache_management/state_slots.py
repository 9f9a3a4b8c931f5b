"""The recurrent-state side of ``BlockManager``: a hybrid model's state slots and the state
snapshots its prefix cache needs.

With a ``state_cache`` (``StateCache``: a hybrid model's recurrent-state slots, the second
cache group beside the blocks, as vLLM v1's ``MambaSpec`` group), a request also takes one
slot when it gets its blocks and gives it back with them: admission needs a free slot too, and
every path that frees a request's blocks (finish, abort, preemption) frees its slot.

Prefix caching for such a model needs ``state_snapshots`` (``StateSnapshotPool``: the state at
every ``interval``-th token, keyed by the hash of the block ending there): a hit then stops at
the last cached block that has a snapshot, which is copied into the request's fresh slot; the
scheduler reserves the snapshots each prefill chunk crosses (``reserve_snapshots``), which
become valid once their blocks are registered, and a block's eviction drops its snapshot.
``StateSlotsMixin`` holds these operations; ``BlockManager.__init__`` sets ``state_cache`` and
``state_snapshots`` (None for a model without recurrent state: every method here is then a
no-op).
"""

from __future__ import annotations

from mm_kv_cache_management.request_state import RequestState

__all__ = ["StateSlotsMixin"]


class StateSlotsMixin:
    """State slots and snapshots (see the module docstring); mixed into ``BlockManager``."""

    def _has_free_slot(self) -> bool:
        return self.state_cache is None or self.state_cache.num_free_slots > 0

    def _slot_text(self) -> str:
        """The free-slot clause of a ``NoFreeBlocksError`` message ("" without a state cache)."""
        return "" if self.state_cache is None else f", and a state slot ({self.state_cache.num_free_slots} free)"

    def _take_slot(self, req: RequestState) -> None:
        if self.state_cache is not None:
            req.state_slot = self.state_cache.allocate()

    def _free_slot(self, req: RequestState) -> None:
        if req.state_slot is not None and self.state_cache is not None:
            self.state_cache.free(req.state_slot)
        req.state_slot = None

    def _hits_ending_at_snapshots(self, hits: list[int], hashes: list[bytes]) -> list[int]:
        """``hits`` cut back to the last block with a snapshot (unchanged without a pool)."""
        if self.state_snapshots is not None:
            while hits and hashes[len(hits) - 1] not in self.state_snapshots:
                hits.pop()
        return hits

    def _drop_snapshot(self, block_hash: bytes) -> None:
        if self.state_snapshots is not None:
            self.state_snapshots.drop(block_hash)

    def _restore_state(self, req: RequestState, num_hits: int) -> None:
        """A hybrid's hit of ``num_hits`` blocks ends at a snapshot: copy it into the request's slot."""
        if self.state_snapshots is None:
            return
        self.state_snapshots.queries += 1
        if num_hits:
            self.state_snapshots.hits += 1
            self.state_snapshots.restore(req.block_hashes(self.block_size)[num_hits - 1], self.state_cache,
                                         req.state_slot)

    def _commit_snapshots(self, req: RequestState) -> None:
        """After ``req``'s chunk is committed: its snapshots are written, valid once their block
        is registered (else discarded), and written through to the KV tier beside the block."""
        if self.state_snapshots is None:
            return
        for _, _, h in req.snapshot_points:
            (self.state_snapshots.validate if h in self._cached else self.state_snapshots.discard)(h)
            if h in self.state_snapshots:
                self._save_snapshot_to_tier(h)
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

    def accept_state_rows(self, req: RequestState, num_rows: int) -> None:
        """After ``req``'s verification step took ``num_rows`` rows (its last sampled token and
        ``num_rows - 1`` accepted drafts): its recurrent state becomes the state after them
        (``StateCache.accept_rows``). No-op without a state cache or a slot.

        Raises:
            ValueError: from ``StateCache.accept_rows`` (no rows kept, ``num_rows`` out of range).
        """
        if self.state_cache is not None and req.state_slot is not None:
            self.state_cache.accept_rows(req.state_slot, num_rows)
