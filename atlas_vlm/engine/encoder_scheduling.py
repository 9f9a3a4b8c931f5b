"""The scheduler's media side (vLLM v1's ``_try_schedule_encoder_inputs`` and
``_free_encoder_inputs``): which media items a prefill chunk reaches, what they cost in the
step's encoder budget, which the runner must encode, and when a request's references to the
encoder cache end. Functions of a ``Scheduler`` (``scheduler.encoder_cache`` is its
``EncoderCacheManager``) over a request's ``mm_features`` (``MediaItem`` s), kept apart so
the scheduler module stays small.
"""

from __future__ import annotations


def _items_in(req, start: int, end: int) -> list:
    """``req``'s media items with a placeholder run in tokens ``start .. end-1``, prompt order."""
    return [f for f in req.mm_features if f.offset < end and start < f.end
            and any(r.offset < end and start < r.end for r in f.ranges)]


def fit_encoder_budget(scheduler, req, n: int, budget: int, fresh: bool) -> tuple[int, int]:
    """``(tokens of the chunk, encoder rows it costs)``: the chunk ``num_computed_tokens ..
    + n`` cut before the first placeholder run whose item is neither cached nor fits
    ``budget`` (rows left this step). ``fresh``: nothing was encoded yet this step, so one item
    over the whole budget may run. Without chunked prefill a chunk is never cut (0 if it does
    not fit). ``max_num_encoder_tokens`` None: no cut."""
    if not req.mm_features or scheduler.max_num_encoder_tokens is None:
        return n, 0
    start = req.num_computed_tokens
    cost, counted = 0, set()
    for item in _items_in(req, start, start + n):
        if scheduler.encoder_cache.is_cached(item.content_hash) or item.content_hash in counted:
            continue
        if cost + item.num_tokens > budget and not (fresh and cost == 0):
            if not scheduler.enable_chunked_prefill:
                return 0, 0
            first = next(r.offset for r in item.ranges if r.end > start)  # its first run this chunk reaches
            return max(0, first - start), cost
        cost += item.num_tokens
        counted.add(item.content_hash)
    return n, cost


def schedule_media(scheduler, req, n: int, out) -> None:
    """``req`` computes ``n`` tokens this step: every media item they reach is referenced in
    the encoder cache, and those not cached are allocated and put in ``out.encoder_inputs``
    (content hash -> the processed item: the runner encodes each once, however many requests
    share it)."""
    if not req.mm_features:
        return
    manager = scheduler.encoder_cache
    start = req.num_computed_tokens
    items = _items_in(req, start, start + n)
    for item in items:  # the cached ones first: making room for the others must not evict them
        if manager.is_cached(item.content_hash):
            manager.reference(req.request_id, item.content_hash)
    for item in items:
        if not manager.is_cached(item.content_hash):
            manager.allocate(req.request_id, item.content_hash, item.num_tokens)
            out.encoder_inputs[item.content_hash] = item.data


def release_computed_media(scheduler, req) -> None:
    """After a step: ``req`` releases every cached item whose placeholder runs it has all
    computed (later chunks no longer need the rows), earlier items first."""
    manager = scheduler.encoder_cache
    held = manager.held_by(req.request_id)
    if not held:
        return
    last_end: dict[str, int] = {}
    for item in req.mm_features:  # prompt order: the earlier item is evicted first
        if item.content_hash in held:
            last_end[item.content_hash] = max(last_end.get(item.content_hash, 0), item.end)
    for content_hash, end in last_end.items():
        if req.num_computed_tokens >= end:
            manager.release(req.request_id, content_hash)
