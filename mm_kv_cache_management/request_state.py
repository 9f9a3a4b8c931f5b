"""The KV-side view of a request: its tokens, media items (each with its placeholder ranges),
blocks and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mm_kv_cache_management.block_table import BlockTable
from mm_kv_cache_management.hashing import block_hash


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_FSM = "waiting_for_fsm"  # queued, its structured-output grammar still compiling (vLLM v1)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class PlaceholderRange:
    """One run of a media item's placeholder tokens in a request's token ids (vLLM v1's
    ``PlaceholderRange`` of a ``MultiModalFeatureSpec``), for any modality.

    A media item fills one run (an image, a Qwen2.5-VL video) or several (a Qwen3-VL video:
    one run per temporal group, timestamp text between; a SmolVLM tile). Run ``k`` of an
    item takes the item's encoder rows ``embed_offset .. embed_offset + length - 1``.
    """

    offset: int  # index of the first placeholder token of this run
    length: int  # placeholder tokens in this run (one per encoder output row)
    content_hash: str  # identifies the item's content (and preprocessing) for prefix caching
    modality: str = "image"  # "image" | "video"
    item_index: int = 0  # which of the request's media items this run belongs to
    embed_offset: int = 0  # the item's encoder row of this run's first token

    @property
    def end(self) -> int:
        """One past the run's last token."""
        return self.offset + self.length


@dataclass(eq=False)
class MediaItem:
    """One media item of a request, the one place a request keeps it (vLLM v1's
    ``MultiModalFeatureSpec``): what it is, where its placeholder tokens sit and what
    identifies its encoder output.

    ``ranges`` are its placeholder runs by offset (one for an image, one per temporal group of
    a Qwen3-VL video), together ``num_tokens`` long; ``data`` is the processed item the vision
    tower encodes (``ProcessedImage`` / ``ProcessedVideo`` / a SmolVLM tile; None where only
    the KV side is exercised). The encoder cache and prefix hashing key it by ``content_hash``.
    """

    modality: str  # "image" | "video"
    content_hash: str  # content (and preprocessing) identity: encoder cache and prefix-cache key
    num_tokens: int  # encoder rows = placeholder tokens over all its runs
    ranges: list[PlaceholderRange]  # its placeholder runs, by offset
    data: object = None  # the processed item the tower takes

    @property
    def offset(self) -> int:
        """Token index of its first placeholder."""
        return self.ranges[0].offset

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.ranges[-1].end


def media_items(ranges: list[PlaceholderRange], items: list | None = None) -> list[MediaItem]:
    """Group placeholder runs into ``MediaItem`` s by ``item_index`` (item order).

    Args:
        ranges: every run of the request (``PlaceholderRange.item_index`` names its item).
        items: the processed items, ``items[k]`` with ``modality``, ``content_hash`` and
            ``num_tokens`` (None: KV-side only, one item per ``(item_index, content_hash)``
            taken from the runs, ``data`` None).

    Raises:
        ValueError: an item's runs disagree with it (hash, modality or row count), or a run
            names an item that is not there.
    """
    if items is None:  # KV-side only: one item per (item_index, content hash), first-run order
        by_key: dict[tuple[int, str], list[PlaceholderRange]] = {}
        for r in sorted(ranges, key=lambda r: r.offset):
            by_key.setdefault((r.item_index, r.content_hash), []).append(r)
        return [MediaItem(runs[0].modality, runs[0].content_hash, sum(r.length for r in runs), runs)
                for runs in by_key.values()]
    grouped: dict[int, list[PlaceholderRange]] = {}
    for r in sorted(ranges, key=lambda r: r.offset):
        grouped.setdefault(r.item_index, []).append(r)
    if set(grouped) - set(range(len(items))):
        raise ValueError(f"placeholder runs name media items {sorted(grouped)} but the request has {len(items)}")
    out = []
    for k in sorted(grouped):
        runs = grouped[k]
        rows = sum(r.length for r in runs)
        item = items[k]
        if (item.content_hash, item.modality, item.num_tokens) != (runs[0].content_hash, runs[0].modality, rows):
            raise ValueError(f"media item {k} ({item.modality}, {item.num_tokens} tokens) does not match its "
                             f"placeholder runs ({runs[0].modality}, {rows} tokens)")
        out.append(MediaItem(item.modality, item.content_hash, item.num_tokens, runs, item))
    return out


@dataclass(eq=False)
class RequestState:
    """Token ids and KV bookkeeping of one request.

    ``token_ids`` holds the prompt followed by the generated tokens; ``num_computed_tokens``
    of them have K/V in the cache. ``rope_delta`` is the M-RoPE offset (HF
    ``get_rope_index``): decode position = context length + ``rope_delta``; 0 for text.
    ``mm_features`` are its media items in prompt order (set at construction).
    """

    request_id: str  # unique per engine
    token_ids: list[int]  # prompt ids, then generated ids
    num_prompt_tokens: int = -1  # length of the prompt part of token_ids (-1: all of it)
    mm_features: list[MediaItem] = field(default_factory=list)  # media items in prompt order
    rope_delta: int = 0  # M-RoPE position offset of decode tokens
    block_table: BlockTable | None = None  # None while no blocks are held
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by prefix-cache hits at admission
    status: RequestStatus = RequestStatus.WAITING
    state_slot: int | None = None  # hybrid models: its ``StateCache`` slot while it holds blocks
    # hybrid models with prefix caching: this step's state snapshots [(tokens into the chunk,
    # snapshot slot, block hash)] (BlockManager.reserve_snapshots / commit_computed)
    snapshot_points: list[tuple[int, int, bytes]] = field(default_factory=list)
    # opaque prefix-cache key (the engine: its LoRA adapter's fingerprint); None: none. Blocks of
    # requests with different salts never match (hashing.block_hash)
    cache_salt: str | None = None
    _block_hashes: list[bytes] = field(default_factory=list, repr=False)  # of full blocks
    _mm_runs: list[PlaceholderRange] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        self._mm_runs = sorted((r for f in self.mm_features for r in f.ranges), key=lambda r: r.offset)

    @property
    def mm_positions(self) -> list[PlaceholderRange]:
        """Every placeholder run of its media items, by offset (a view of ``mm_features``)."""
        return self._mm_runs

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    def block_hashes(self, block_size: int, num_tokens: int | None = None) -> list[bytes]:
        """Chained hashes of the full blocks among the first ``num_tokens`` tokens.

        Memoised: a block's hash depends only on tokens before its end, which never change.
        """
        limit = self.num_tokens if num_tokens is None else num_tokens
        num_full = limit // block_size
        while len(self._block_hashes) < num_full:
            i = len(self._block_hashes)
            start, end = i * block_size, (i + 1) * block_size
            extra = [
                (span.content_hash, span.embed_offset + start - span.offset)
                for span in self.mm_positions
                if span.offset < end and start < span.end
            ]
            parent = self._block_hashes[-1] if i else None
            self._block_hashes.append(block_hash(parent, self.token_ids[start:end], extra, self.cache_salt))
        return self._block_hashes[:num_full]
