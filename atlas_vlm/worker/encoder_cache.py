"""``EncoderCache``: vision-tower outputs by content hash, bounded in tokens (encoder rows).

Scope: the runner's cache of encoder outputs (vLLM v1's ``EncoderCacheManager``, bounded
the same way: by rows, not items), for any modality: a repeated image or video (same
content hash, i.e. same pixels / frames and preprocessing) is encoded once. Least recently
used entries go first; entries the current step still needs are pinned and never evicted
while pinned, so one step may briefly hold more than the capacity.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """LRU map ``content_hash -> [num_tokens, columns]`` holding at most ``capacity_tokens`` rows.

    Args:
        capacity_tokens: encoder rows kept in all (``EngineConfig.encoder_cache_tokens``);
            0 keeps nothing between steps (every item is encoded when needed).

    Raises:
        ValueError: a negative capacity.
    """

    def __init__(self, capacity_tokens: int):
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
            raise ValueError(f"encoder cache capacity must be an int >= 0 (tokens), got {capacity_tokens!r}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pinned: set[str] = set()
        self.num_rows = 0  # rows held now

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, content_hash: str) -> torch.Tensor:
        """The cached rows (marked most recently used). Raises ``KeyError`` if absent."""
        self._entries.move_to_end(content_hash)
        return self._entries[content_hash]

    def put(self, content_hash: str, rows: torch.Tensor) -> None:
        """Store one item's rows ``[num_tokens, columns]``, pinned until :meth:`unpin_all`."""
        if content_hash in self._entries:
            self.num_rows -= self._entries.pop(content_hash).shape[0]
        self._entries[content_hash] = rows
        self.num_rows += rows.shape[0]
        self._pinned.add(content_hash)

    def pin(self, content_hash: str) -> None:
        """Keep an entry through the next :meth:`evict` (the step that uses it)."""
        self._pinned.add(content_hash)

    def unpin_all(self) -> None:
        """End of a step: nothing is pinned; evict down to the capacity."""
        self._pinned.clear()
        self.evict()

    def evict(self) -> None:
        """Drop least recently used unpinned entries until at most ``capacity_tokens`` rows remain."""
        for key in [k for k in self._entries if k not in self._pinned]:
            if self.num_rows <= self.capacity_tokens:
                break
            self.num_rows -= self._entries.pop(key).shape[0]

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self._pinned.clear()
        self.num_rows = 0
