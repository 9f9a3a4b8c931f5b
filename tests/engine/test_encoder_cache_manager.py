"""The encoder-cache manager beside the scheduler (vLLM v1's ``EncoderCacheManager``),
without weights: rows bounded by the capacity, references per request (a referenced entry is
never evicted), a shared image encoded once across requests, an aborted request releasing
its references, and a preempted request re-encoding only what was evicted meanwhile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atlas_vlm.engine.encoder_cache_manager import EncoderCacheManager
from atlas_vlm.engine.input_processor import placeholder_ranges
from atlas_vlm.engine.scheduler import Scheduler, SchedulerOutput
from atlas_vlm.request import Request
from mm_kv_cache_management import BlockManager, media_items

pytestmark = pytest.mark.vlm

IMG = 7  # the placeholder token id


def image(num_tokens: int, content_hash: str):
    return SimpleNamespace(modality="image", num_tokens=num_tokens, content_hash=content_hash)


def request(rid: str, layout: list) -> Request:
    """Token ids from ``layout``: ints are text runs, images their placeholder runs."""
    ids, items = [], []
    for part in layout:
        ids += [1] * part if isinstance(part, int) else [IMG] * part.num_tokens
        if not isinstance(part, int):
            items.append(part)
    ranges = placeholder_ranges(ids, items, {"image": IMG, "video": IMG})
    return Request(rid, ids, mm_features=media_items(ranges, items), max_tokens=4)


def sampled(n: int):
    return list(range(n)), SimpleNamespace(token_ids=[5] * n, errors=[None] * n, logprobs=[None] * n,
                                           top_logprobs=[None] * n)


def scheduler(capacity: int, budget: int = 1000, encoder_budget: int | None = 1000) -> Scheduler:
    return Scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=budget,
                     max_num_encoder_tokens=encoder_budget, encoder_cache=EncoderCacheManager(capacity))


def test_rows_are_bounded_and_referenced_entries_are_never_evicted():
    m = EncoderCacheManager(10)
    m.allocate("r1", "a", 6)
    m.allocate("r2", "b", 6)
    assert m.num_rows == 12 and m.is_cached("a") and m.is_cached("b")  # both referenced: over capacity
    m.release("r1", "a")
    assert not m.is_cached("a") and m.num_rows == 6 and m.take_freed() == ["a"]
    m.allocate("r3", "c", 3)
    m.release("r3", "c")
    m.release("r2", "b")  # b released after c: c goes first
    m.allocate("r4", "d", 4)
    assert (m.is_cached("b"), m.is_cached("c"), m.is_cached("d")) == (True, False, True)
    assert m.num_rows == 10 and m.take_freed() == ["c"] and m.take_freed() == []
    m.reference("r5", "b")  # a cached entry taken again: no longer evictable
    m.release("r4", "d")
    m.allocate("r6", "e", 8)
    assert m.is_cached("b") and not m.is_cached("d") and m.num_rows == 14
    with pytest.raises(ValueError, match="cached already"):
        m.allocate("r7", "b", 6)
    with pytest.raises(KeyError, match="not in the encoder cache"):
        m.reference("r7", "zz")
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        EncoderCacheManager(-1)
    zero = EncoderCacheManager(0)
    zero.allocate("r", "x", 2)
    assert zero.is_cached("x")  # kept while referenced ...
    zero.free("r")
    assert not zero.is_cached("x") and len(zero) == 0 and zero.take_freed() == ["x"]  # ... and not after


def test_a_shared_image_is_encoded_once_and_counted_once_in_the_budget():
    sched = scheduler(capacity=100, encoder_budget=10)
    a, b = request("a", [2, image(8, "cat"), 3]), request("b", [4, image(8, "cat"), 1])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.chunks == [(a, 13), (b, 13)]  # 8 rows once: both fit a budget of 10
    assert list(out.encoder_inputs) == ["cat"] and sched.encoder_cache.num_refs("cat") == 2
    sched.update_from_output(out, sampled(2))  # both prompts computed: the rows are no longer needed
    assert sched.encoder_cache.num_refs("cat") == 0 and sched.encoder_cache.is_cached("cat")
    c = request("c", [1, image(8, "cat")])
    sched.add_request(c)
    out = sched.schedule()
    assert (c, 9) in out.chunks and out.encoder_inputs == {}  # a cache hit: nothing to encode
    assert sched.encoder_cache.held_by("c") == {"cat"}


def test_a_request_keeps_its_reference_until_its_chunks_pass_the_item():
    sched = scheduler(capacity=0, budget=6)
    a = request("a", [2, image(8, "cat"), 2])
    sched.add_request(a)
    out = sched.schedule()
    assert out.chunks == [(a, 6)] and list(out.encoder_inputs) == ["cat"]
    sched.update_from_output(out, ([], None))
    assert sched.encoder_cache.num_refs("cat") == 1  # tokens 6..9 of the image still to compute
    out = sched.schedule()
    assert out.chunks == [(a, 6)] and out.encoder_inputs == {}  # the rest of the image: its rows kept
    sched.update_from_output(out, sampled(1))
    assert not sched.encoder_cache.is_cached("cat")  # capacity 0: gone once nobody needs it
    assert sched.schedule().freed_encoder_hashes == ["cat"]  # the runner is told to drop the rows


def test_an_aborted_request_releases_its_references():
    sched = scheduler(capacity=0, budget=4)
    a = request("a", [1, image(8, "x"), 1])
    sched.add_request(a)
    out = sched.schedule()
    assert list(out.encoder_inputs) == ["x"]
    sched.update_from_output(out, ([], None))
    assert sched.encoder_cache.held_by("a") == {"x"}  # mid-image
    sched.finish(a, "abort")
    assert sched.encoder_cache.held_by("a") == set() and not sched.encoder_cache.is_cached("x")
    assert sched.schedule().freed_encoder_hashes == ["x"]


def test_preemption_re_encodes_only_what_was_evicted():
    sched = scheduler(capacity=16)
    a = request("a", [2, image(8, "i1"), 2, image(8, "i2"), 2])
    sched.add_request(a)
    out = sched.schedule()
    assert list(out.encoder_inputs) == ["i1", "i2"]
    sched.update_from_output(out, sampled(1))
    assert sched.encoder_cache.held_by("a") == set()  # prompt computed: both cached, unreferenced
    sched._preempt(a, SchedulerOutput())  # what a decode with no free block does to the newest request
    assert a.num_computed_tokens == 0
    sched.encoder_cache.allocate("other", "i3", 8)  # another request's image: room for it evicts i1
    assert not sched.encoder_cache.is_cached("i1") and sched.encoder_cache.is_cached("i2")
    out = sched.schedule()
    assert out.chunks == [(a, 23)] and list(out.encoder_inputs) == ["i1"]  # i2 still cached: not re-encoded
    assert out.freed_encoder_hashes == ["i1"] and sched.encoder_cache.held_by("a") == {"i1", "i2"}
