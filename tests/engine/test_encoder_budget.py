"""The multimodal core without weights: placeholder ranges and the scheduler's encoder
budget per step (vLLM v1's ``encoder_compute_budget``): which chunk reaches which media item, for any modality."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atlas_vlm.engine.encoder_cache_manager import EncoderCacheManager
from atlas_vlm.engine.input_processor import placeholder_ranges
from atlas_vlm.engine.scheduler import Scheduler
from atlas_vlm.request import Request
from mm_kv_cache_management import BlockManager, PlaceholderRange, media_items

pytestmark = pytest.mark.vlm

IMG, VID = 7, 8  # placeholder token ids


def item(modality: str, num_tokens: int, content_hash: str):
    return SimpleNamespace(modality=modality, num_tokens=num_tokens, content_hash=content_hash)


def request(rid: str, layout: list, rows=None) -> Request:
    """Token ids from ``layout``: ints are text runs, items their placeholder runs."""
    ids, items = [], []
    for part in layout:
        if isinstance(part, int):
            ids += [1] * part
        else:
            ids += [IMG if part.modality == "image" else VID] * part.num_tokens
            items.append(part)
    ranges = placeholder_ranges(ids, items, {"image": IMG, "video": VID})
    return Request(rid, ids, mm_features=media_items(ranges, items), max_tokens=4)


def scheduler(budget: int, encoder_budget: int | None, encoded=()) -> Scheduler:
    """A scheduler whose encoder cache already holds the items of ``encoded`` (hash -> rows)."""
    manager = EncoderCacheManager(1000)
    for content_hash, rows in dict(encoded).items():
        manager.allocate("earlier", content_hash, rows)
    manager.free("earlier")
    return Scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=budget,
                     max_num_encoder_tokens=encoder_budget, encoder_cache=manager)


def test_placeholder_ranges_one_run_per_image_and_many_per_qwen3_video():
    a, v, b = item("image", 3, "a"), item("video", 6, "v"), item("image", 2, "b")
    ids = [1, IMG, IMG, IMG, 1, VID, VID, VID, 1, 1, VID, VID, VID, 1, IMG, IMG]  # video: 2 groups of 3
    got = placeholder_ranges(ids, [a, v, b], {"image": IMG, "video": VID})
    assert got == [PlaceholderRange(1, 3, "a", "image", 0, 0), PlaceholderRange(5, 3, "v", "video", 1, 0),
                   PlaceholderRange(10, 3, "v", "video", 1, 3), PlaceholderRange(14, 2, "b", "image", 2, 0)]
    # two adjacent items of one token id (SmolVLM frames) split by their own sizes
    got = placeholder_ranges([1, IMG, IMG, IMG, IMG, IMG], [item("image", 2, "x"), item("video", 3, "y")],
                             {"image": IMG, "video": IMG})
    assert [(r.offset, r.length, r.item_index) for r in got] == [(1, 2, 0), (3, 3, 1)]
    with pytest.raises(ValueError, match=r"placeholder tokens \{'image': 3, 'video': 0\} but its media items "
                                         r"need \{'image': 4, 'video': 0\}"):
        placeholder_ranges([1, IMG, IMG, IMG], [item("image", 4, "a")], {"image": IMG, "video": VID})
    with pytest.raises(ValueError, match="placeholder tokens"):
        placeholder_ranges([IMG, IMG, IMG], [item("image", 2, "a")], {"image": IMG, "video": VID})


def test_a_request_holds_one_media_item_per_item_with_all_its_runs():
    a, v = item("image", 3, "a"), item("video", 6, "v")
    ids = [1, IMG, IMG, IMG, 1, VID, VID, VID, 1, 1, VID, VID, VID]  # the video: 2 groups of 3
    req = Request("r", ids, mm_features=media_items(placeholder_ranges(ids, [a, v], {"image": IMG, "video": VID}),
                                                    [a, v]))
    got = [(f.modality, f.content_hash, f.num_tokens, [(r.offset, r.length) for r in f.ranges], f.data)
           for f in req.mm_features]
    assert got == [("image", "a", 3, [(1, 3)], a), ("video", "v", 6, [(5, 3), (10, 3)], v)]
    assert [(r.offset, r.content_hash) for r in req.mm_positions] == [(1, "a"), (5, "v"), (10, "v")]
    assert (req.mm_features[1].offset, req.mm_features[1].end) == (5, 13)
    with pytest.raises(ValueError, match=r"media item 0 \(image, 4 tokens\) does not match its placeholder runs "
                                         r"\(image, 3 tokens\)"):
        media_items([PlaceholderRange(1, 3, "a")], [item("image", 4, "a")])
    with pytest.raises(ValueError, match=r"placeholder runs name media items \[0, 1\] but the request has 1"):
        media_items([PlaceholderRange(1, 3, "a"), PlaceholderRange(5, 2, "b", item_index=1)], [a])


def test_a_chunk_stops_before_the_item_that_does_not_fit_the_encoder_budget():
    sched = scheduler(budget=1000, encoder_budget=40)
    first = request("a", [5, item("image", 30, "i1"), 5, item("video", 30, "v1"), 5])
    sched.add_request(first)
    (chunk,) = sched.schedule().chunks
    assert chunk == (first, 40)  # text 5 + image 30 (30 rows) + text 5; the video's 30 rows wait


def test_an_item_over_the_whole_budget_runs_alone_and_cached_items_cost_nothing():
    sched = scheduler(budget=1000, encoder_budget=16)
    big = request("big", [2, item("video", 64, "v")])
    other = request("other", [3, item("image", 8, "i")])
    sched.add_request(big)
    sched.add_request(other)
    out = sched.schedule()
    assert out.chunks == [(big, 66), (other, 3)]  # 64 rows > 16: runs, the only item of the step;
    # "other" computes its text and stops before its image (offset 3) ...
    sampled = SimpleNamespace(token_ids=[5], errors=[None], logprobs=[None], top_logprobs=[None])
    sched.update_from_output(out, ([0], sampled))  # big sampled one token
    out = sched.schedule()
    assert out.chunks == [(big, 1), (other, 8)]  # ... which runs in the next step (big decodes)
    sched = scheduler(budget=1000, encoder_budget=16, encoded={"v": 64})
    big, other = request("big", [2, item("video", 64, "v")]), request("other", [3, item("image", 8, "i")])
    sched.add_request(big)
    sched.add_request(other)
    assert sched.schedule().chunks == [(big, 66), (other, 11)]  # the video is in the encoder cache


def test_without_an_encoder_budget_only_tokens_bound_a_step():
    sched = scheduler(budget=50, encoder_budget=None)
    req = request("a", [5, item("image", 30, "i1"), 5, item("image", 30, "i2")])
    sched.add_request(req)
    assert sched.schedule().chunks == [(req, 50)]
