"""``EncoderCacheManager``: the scheduler's view of the encoder cache (vLLM v1's
``EncoderCacheManager``), for media items of any modality.

It holds no tensors: the runner stores each item's encoder rows by content hash
(``ModelRunner.encoder_outputs``) and this manager decides what is there. Per step the
scheduler asks it which items a chunk needs (``is_cached``), ``allocate``s the items the
runner must encode (carried by ``SchedulerOutput.encoder_inputs``) and ``reference``s the ones
already cached. An entry is referenced by every request that still needs its rows (its
placeholder tokens are not all computed yet); a referenced entry is never evicted. An entry
nobody references stays cached for reuse (a repeated image is encoded once) until room is
needed: least recently released first, down to ``capacity_tokens`` rows. Evicted hashes are
handed to the runner with the next step (``take_freed``), which drops their rows.

Bounded in rows (encoder output tokens), as vLLM's; unlike vLLM an item is never refused
for lack of room: referenced entries may hold more than the capacity for a while, which keeps
the behaviour of the runner-side LRU cache this replaced (one item over the whole capacity
still runs).
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    """Which content hashes have encoder rows in the runner, and which requests need them.

    Args:
        capacity_tokens: rows kept in all by unreferenced entries and referenced ones together
            (``EngineConfig.encoder_cache_tokens``); 0 keeps an entry only while a request
            references it.

    Raises:
        ValueError: a capacity that is not an int >= 0.
    """

    def __init__(self, capacity_tokens: int):
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
            raise ValueError(f"encoder cache capacity must be an int >= 0 (tokens), got {capacity_tokens!r}")
        self.capacity_tokens = capacity_tokens
        self._rows: dict[str, int] = {}  # cached content hash -> its encoder rows
        self._refs: dict[str, set[str]] = {}  # cached content hash -> request ids that still need it
        self._held: dict[str, dict[str, None]] = {}  # request id -> content hashes it references, in order
        self._freeable: OrderedDict[str, None] = OrderedDict()  # unreferenced cached hashes, oldest first
        self._freed: list[str] = []  # evicted since the last take_freed
        self.num_rows = 0  # rows of all cached entries

    def __len__(self) -> int:
        return len(self._rows)

    def is_cached(self, content_hash: str) -> bool:
        """Whether the runner holds (or this step will hold) the item's rows."""
        return content_hash in self._rows

    def num_refs(self, content_hash: str) -> int:
        """Requests referencing a cached entry (0 if unreferenced or absent)."""
        return len(self._refs.get(content_hash, ()))

    def held_by(self, request_id: str) -> set[str]:
        """The content hashes ``request_id`` references (a copy)."""
        return set(self._held.get(request_id, ()))

    def reference(self, request_id: str, content_hash: str) -> None:
        """``request_id`` needs a cached entry's rows: it is not evicted until released.

        Raises:
            KeyError: the hash is not cached (``allocate`` it instead).
        """
        if content_hash not in self._rows:
            raise KeyError(f"content hash {content_hash!r} is not in the encoder cache; allocate it first")
        self._refs[content_hash].add(request_id)
        self._held.setdefault(request_id, {})[content_hash] = None
        self._freeable.pop(content_hash, None)

    def allocate(self, request_id: str, content_hash: str, num_tokens: int) -> None:
        """Make room for a new entry of ``num_tokens`` rows the runner will encode this step,
        referenced by ``request_id``; unreferenced entries are evicted, oldest first, while
        the cache holds more than its capacity.

        Raises:
            ValueError: the hash is cached already, or ``num_tokens`` < 1.
        """
        if content_hash in self._rows:
            raise ValueError(f"content hash {content_hash!r} is cached already; reference it instead")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"an encoder cache entry needs an int >= 1 of rows, got {num_tokens!r}")
        self._rows[content_hash] = num_tokens
        self._refs[content_hash] = set()
        self.num_rows += num_tokens
        self.reference(request_id, content_hash)
        self._evict()

    def release(self, request_id: str, content_hash: str) -> None:
        """``request_id`` no longer needs the entry (its placeholder tokens are computed); the
        entry becomes evictable once no request references it. Unknown pairs are ignored."""
        held = self._held.get(request_id)
        if held is None or content_hash not in held:
            return
        del held[content_hash]
        if not held:
            del self._held[request_id]
        refs = self._refs.get(content_hash)
        if refs is not None:
            refs.discard(request_id)
            if not refs:
                self._freeable[content_hash] = None
        self._evict()

    def free(self, request_id: str) -> None:
        """Release every entry ``request_id`` references (it finished, was aborted or preempted),
        in the order it took them."""
        for content_hash in list(self._held.get(request_id, ())):
            self.release(request_id, content_hash)

    def forget(self, content_hashes) -> None:
        """Drop entries whose rows the runner does not hold after all (the step that was to
        encode them raised); their references go too."""
        for content_hash in content_hashes:
            if content_hash in self._rows:
                self._drop(content_hash)

    def clear(self) -> None:
        """Evict every unreferenced entry (``LLM.reset_mm_cache`` / ``LLMEngine.reset_mm_cache``)."""
        for content_hash in list(self._freeable):
            self._drop(content_hash)
            self._freed.append(content_hash)

    def take_freed(self) -> list[str]:
        """The hashes evicted since the last call (the runner drops their rows)."""
        freed, self._freed = self._freed, []
        return freed

    def _evict(self) -> None:
        while self.num_rows > self.capacity_tokens and self._freeable:
            content_hash = next(iter(self._freeable))
            self._drop(content_hash)
            self._freed.append(content_hash)

    def _drop(self, content_hash: str) -> None:
        self.num_rows -= self._rows.pop(content_hash)
        for request_id in self._refs.pop(content_hash, ()):
            held = self._held.get(request_id)
            if held is not None:
                held.pop(content_hash, None)
                if not held:
                    del self._held[request_id]
        self._freeable.pop(content_hash, None)
