"""Snapshots of a hybrid model's recurrent state at block boundaries: what makes prefix caching
exact for models with linear-attention layers (vLLM's "align" mode idea).

A prefix-cache hit skips the computation of the hit tokens; for the full-attention layers the
cached K/V blocks stand in for it, but a Gated DeltaNet layer's state after those tokens is
a single fixed-size tensor per sequence, not in any block. So while a hybrid sequence
prefills, its linear-attention layers also write their state (conv + recurrent, every layer:
``StateSpec.bytes_per_seq`` bytes) after every ``interval``-th token into one slot of this
pool, keyed by the chained hash of the block that ends at that token. A later request whose
cached prefix reaches such a block starts from a copy of that state.

Bounded: ``num_slots`` snapshots, preallocated (``num_slots * bytes_per_seq`` fp32 bytes, off
the KV budget). A snapshot goes when the block its hash names leaves the prefix cache
(``BlockManager`` calls ``drop``), or, when the pool is full, least recently used first; so a
snapshot never outlives its block hash. With a disk KV tier (``kv_tier.py``) each snapshot is
also written beside its block's file and read back into this pool on a disk hit.

Life of a snapshot: ``reserve`` (at schedule time: a slot the step's forward writes into,
pending) -> ``validate`` (after the forward, once the block is registered) or ``discard``.
Pending ones are never handed out or evicted; ``discard_pending`` forgets those of a step that
never completed.
"""

from __future__ import annotations

from collections import OrderedDict

from mm_kv_cache_management.state_cache import StateCache, StateSpec


class StateSnapshotPool:
    """``num_slots`` snapshots of ``spec``'s state, taken every ``interval`` tokens.

    ``storage`` is a ``StateCache`` of ``num_slots`` (its ``conv`` / ``recurrent`` tensors hold
    the snapshots; its own slot allocator is unused). ``hits`` / ``queries``: admissions restored
    from a snapshot / admissions of a hybrid request that looked one up (totals, for metrics).

    Raises:
        ValueError: ``num_slots`` < 1, or ``interval`` not a positive multiple of ``block_size``.
    """

    def __init__(self, spec: StateSpec, num_slots: int, interval: int, block_size: int, device="cpu"):
        if num_slots < 1:
            raise ValueError(f"max_state_snapshots must be >= 1 for a snapshot pool, got {num_slots}")
        if interval < 1 or interval % block_size:
            raise ValueError(f"hybrid_snapshot_interval must be a positive multiple of the block size "
                             f"({block_size}), got {interval}")
        self.storage = StateCache(spec, num_slots, device=device)
        self.num_slots, self.interval, self.block_size = num_slots, interval, block_size
        self._valid: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._pending: dict[bytes, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self.hits = self.queries = 0

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (``num_slots * spec.bytes_per_seq``)."""
        return self.storage.conv.nbytes + self.storage.recurrent.nbytes

    def __len__(self) -> int:
        """Valid snapshots held."""
        return len(self._valid)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._valid

    def clear(self) -> None:
        """Forget every snapshot (a new, empty prefix cache)."""
        self._valid.clear()
        self._pending.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for the snapshot of ``block_hash`` (pending until ``validate``), evicting the
        least recently used valid snapshot if none is free; None when it is held already or
        every slot is pending."""
        if block_hash in self._valid or block_hash in self._pending:
            return None
        if not self._free:
            if not self._valid:
                return None
            _, slot = self._valid.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._pending[block_hash] = slot
        return slot

    def validate(self, block_hash: bytes) -> None:
        """A pending snapshot's forward ran and its block is registered: it may now be hit."""
        slot = self._pending.pop(block_hash, None)
        if slot is not None:
            self._valid[block_hash] = slot

    def discard(self, block_hash: bytes) -> None:
        """Forget a pending snapshot (its block was not registered)."""
        slot = self._pending.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def discard_pending(self) -> None:
        """Forget every pending snapshot (a step that did not complete)."""
        self._free.extend(self._pending.values())
        self._pending.clear()

    def drop(self, block_hash: bytes) -> None:
        """Forget the snapshot of ``block_hash`` (its block left the prefix cache), if any."""
        slot = self._valid.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def restore(self, block_hash: bytes, cache: StateCache, slot: int) -> None:
        """Copy the snapshot of ``block_hash`` into ``cache``'s ``slot`` (every layer) and mark it
        recently used.

        Raises:
            KeyError: no valid snapshot of ``block_hash``.
        """
        src = self._valid[block_hash]
        self._valid.move_to_end(block_hash)
        cache.conv[:, slot].copy_(self.storage.conv[:, src])
        cache.recurrent[:, slot].copy_(self.storage.recurrent[:, src])

    def snapshot(self, block_hash: bytes) -> tuple:
        """``(conv, recurrent)`` views of the valid snapshot of ``block_hash`` (``[num_layers,
        conv_dim, kernel - 1]``, ``[num_layers, v_heads, k_head_dim, v_head_dim]``).

        Raises:
            KeyError: no valid snapshot of ``block_hash``.
        """
        slot = self._valid[block_hash]
        return self.storage.conv[:, slot], self.storage.recurrent[:, slot]

    def put(self, block_hash: bytes, conv, recurrent) -> bool:
        """Hold ``(conv, recurrent)`` (shapes as ``snapshot``'s; a snapshot read from disk) as the
        valid snapshot of ``block_hash``; False (nothing held) when no slot can be reserved."""
        slot = self.reserve(block_hash)
        if slot is None:
            return block_hash in self._valid
        self.storage.conv[:, slot].copy_(conv)
        self.storage.recurrent[:, slot].copy_(recurrent)
        self.validate(block_hash)
        return True
