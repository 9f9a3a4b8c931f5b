"""The hand-off between ``BlockManager``'s prefix cache and the KV tier below it.

With a ``kv_tier`` (``KVBlockTier``: a disk tier below the prefix cache), every block is also
written there when it is registered (write-through; ``kv_tier.py`` says why), and admission
goes on past the last in-memory hit: each next block hash found in the tier is loaded into one
of the request's fresh blocks, registered, and counts as cached. Hashes are chained, so the
walk stops at the first block found in neither. A hybrid model's state snapshots travel the
same way, beside their blocks' files. ``TierHandoffMixin`` holds these operations;
``BlockManager.__init__`` sets ``kv_tier`` (None: every method here is a no-op).
"""

from __future__ import annotations

from mm_kv_cache_management.request_state import RequestState

__all__ = ["TierHandoffMixin"]


class TierHandoffMixin:
    """Write-through to the KV tier and loads from it (see the module docstring)."""

    def _save_to_tier(self, block_hash: bytes, block_id: int) -> None:
        if self.kv_tier is not None:
            self.kv_tier.save(block_hash, block_id)  # write-through (a no-op if on disk already)

    def _save_snapshot_to_tier(self, block_hash: bytes) -> None:
        if self.kv_tier is not None:
            self.kv_tier.save_snapshot(block_hash)  # write-through, beside its block's file

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
                self._register(block_id, h)
        return len(loaded)
