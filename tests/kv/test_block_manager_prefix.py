"""BlockManager accounting, in the style of vLLM's block pool tests: exact block ids, exact
reference counts, exact free counts (MAC-3, MAC-4 at the bookkeeping level). This file: prefix
caching, cases C11 and C12; allocation, LRU, decode, free and C10 are in
test_block_manager_alloc.py."""

from __future__ import annotations

import pytest

from helpers import compute_all, make_req, ref_counts, snapshot
from mm_kv_cache_management import (BlockManager, PlaceholderRange, NoFreeBlocksError, RequestState, block_hash,
                                     media_items)

pytestmark = pytest.mark.text


# ---- prefix caching -----------------------------------------------------------------------
def test_cache_full_blocks_registers_only_full_computed_blocks():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    r = make_req("a", 10)
    assert bm.prefill_allocate(r).block_ids == [0, 1, 2]
    hashes = r.block_hashes(4)
    assert len(hashes) == 2  # 10 tokens: 2 full blocks
    bm.cache_full_blocks(r)  # nothing computed yet
    assert [b.block_hash for b in bm.blocks] == [None] * 6
    assert bm._cached == {}
    r.num_computed_tokens = 7  # block 0 full and computed, block 1 not
    bm.cache_full_blocks(r)
    assert [b.block_hash for b in bm.blocks] == [hashes[0]] + [None] * 5
    assert bm._cached == {hashes[0]: 0}
    r.num_computed_tokens = 10  # block 1 now full and computed; block 2 partial
    bm.cache_full_blocks(r)
    assert [b.block_hash for b in bm.blocks] == [hashes[0], hashes[1]] + [None] * 4
    assert bm._cached == {hashes[0]: 0, hashes[1]: 1}
    bm.cache_full_blocks(r)  # idempotent
    assert bm._cached == {hashes[0]: 0, hashes[1]: 1}


def test_cache_full_blocks_is_a_no_op_without_prefix_caching():
    bm = BlockManager(4, 4)
    r = make_req("a", 8)
    bm.prefill_allocate(r)
    compute_all(bm, r)
    assert [b.block_hash for b in bm.blocks] == [None] * 4
    assert bm._cached == {}
    r2 = make_req("b", 8)  # same tokens: no sharing when caching is off
    assert bm.prefill_allocate(r2).block_ids == [2, 3]
    assert r2.num_computed_tokens == 0


def test_identical_prompts_share_nothing_without_prefix_caching():
    bm = BlockManager(8, 4)
    a, b = make_req("a", 12), make_req("b", 12)
    bm.prefill_allocate(a)
    compute_all(bm, a)
    assert bm.prefill_allocate(b).block_ids == [3, 4, 5]
    assert ref_counts(bm) == [1, 1, 1, 1, 1, 1, 0, 0]


def test_c11_same_two_block_prompt_shares_block_0_only():
    bs = 16
    bm = BlockManager(8, bs, enable_prefix_caching=True)
    prompt = list(range(1000, 1000 + 2 * bs))
    a = RequestState("a", list(prompt))
    assert bm.prefill_allocate(a).block_ids == [0, 1]
    assert a.num_computed_tokens == 0 and a.num_cached_tokens == 0
    compute_all(bm, a)
    assert bm.blocks[0].block_hash is not None and bm.blocks[1].block_hash is not None

    b = RequestState("b", list(prompt))
    assert bm.can_allocate(b) is True
    table = bm.prefill_allocate(b)
    # block 1 holds b's last prompt token: b must compute it, so it is not a hit
    assert table.block_ids == [0, 2]
    assert b.num_computed_tokens == bs
    assert b.num_cached_tokens == bs
    assert table.num_tokens == bs
    assert ref_counts(bm) == [2, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    compute_all(bm, b)  # block 2 has block 1's hash, already registered to block 1
    assert bm.blocks[2].block_hash is None
    assert bm._cached == {bm.blocks[0].block_hash: 0, bm.blocks[1].block_hash: 1}

    # first decode token of each: new blocks, the shared block is never written
    for r, slot in ((a, 3 * bs), (b, 4 * bs)):
        r.token_ids.append(5)
        assert bm.decode_append(r) == slot
    assert a.block_table.block_ids == [0, 1, 3]
    assert b.block_table.block_ids == [0, 2, 4]

    bm.free_request(a)
    assert ref_counts(bm) == [1, 0, 1, 0, 1, 0, 0, 0]
    assert bm.blocks[1].block_hash is not None  # freed but still cached
    bm.free_request(b)
    assert ref_counts(bm) == [0] * 8
    assert bm.num_free_blocks == 8
    # queue now: 5, 6, 7, 3, 1, 4, 2, 0 (a freed tail first: 3, 1; b: 4, 2, 0)
    c = RequestState("c", list(prompt))
    assert bm.prefill_allocate(c).block_ids == [0, 5]
    assert c.num_computed_tokens == bs
    assert bm.blocks[1].block_hash is not None and bm.blocks[1].ref_count == 0


def test_prompt_one_past_two_blocks_hits_both():
    bs = 16
    bm = BlockManager(8, bs, enable_prefix_caching=True)
    prompt = list(range(2 * bs + 1))
    a = RequestState("a", list(prompt))
    assert bm.prefill_allocate(a).block_ids == [0, 1, 2]
    compute_all(bm, a)
    b = RequestState("b", list(prompt))
    assert bm.prefill_allocate(b).block_ids == [0, 1, 3]
    assert b.num_computed_tokens == 2 * bs == b.num_cached_tokens
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    # a prompt that diverges inside block 1 hits block 0 only
    c = RequestState("c", prompt[:20] + [-1] + prompt[21:])
    assert bm.prefill_allocate(c).block_ids == [0, 4, 5]
    assert c.num_computed_tokens == bs
    assert ref_counts(bm)[:6] == [3, 2, 1, 1, 1, 1]


def test_hit_requires_the_whole_chain_not_just_the_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = RequestState("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.prefill_allocate(a)
    compute_all(bm, a)
    # same second block, different first block: chained hash differs, no hit at all
    b = RequestState("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.prefill_allocate(b).block_ids == [3, 4, 5]
    assert b.num_computed_tokens == 0
    assert ref_counts(bm)[:6] == [1, 1, 1, 1, 1, 1]


def test_hits_are_only_computed_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = RequestState("a", list(range(12)))
    bm.prefill_allocate(a)  # allocated, not yet computed, not cached
    b = RequestState("b", list(range(12)))
    assert bm.prefill_allocate(b).block_ids == [3, 4, 5]
    assert b.num_computed_tokens == 0
    # a and b both compute; a registers first, b's identical blocks stay unregistered
    compute_all(bm, a)
    compute_all(bm, b)
    assert [bm.blocks[i].block_hash is not None for i in range(6)] == [True, True, True, False, False, False]
    bm.free_request(a)
    bm.free_request(b)
    c = RequestState("c", list(range(13)))
    assert bm.prefill_allocate(c).block_ids == [0, 1, 2, 6]
    assert c.num_computed_tokens == 12


def _image_request(rid: str, content_hash: str, offset: int, length: int, total: int) -> RequestState:
    pad = 151655  # <|image_pad|>
    ids = [10 + i for i in range(offset)] + [pad] * length + [500 + i for i in range(total - offset - length)]
    return RequestState(rid, ids, mm_features=media_items([PlaceholderRange(offset, length, content_hash)]))


def test_c12_different_images_on_same_pad_ids_never_share_a_block():
    bs = 4
    bm = BlockManager(16, bs, enable_prefix_caching=True)
    # block 0: text; blocks 1, 2: image pads; block 3: text; block 4: partial text
    a = _image_request("a", "hashA", offset=4, length=8, total=17)
    b = _image_request("b", "hashB", offset=4, length=8, total=17)
    assert a.token_ids == b.token_ids  # only the image content differs
    ha, hb = a.block_hashes(bs), b.block_hashes(bs)
    assert ha[0] == hb[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:]))  # image blocks, and the text block after them
    assert bm.prefill_allocate(a).block_ids == [0, 1, 2, 3, 4]
    compute_all(bm, a)
    assert len(bm._cached) == 4
    table = bm.prefill_allocate(b)
    assert table.block_ids == [0, 5, 6, 7, 8]  # the text block before the image only
    assert b.num_computed_tokens == bs
    assert ref_counts(bm)[:9] == [2, 1, 1, 1, 1, 1, 1, 1, 1]
    compute_all(bm, b)
    assert [bm.blocks[i].block_hash for i in (5, 6, 7)] == hb[1:4]
    # the same image again shares every full block before its last prompt token
    c = _image_request("c", "hashA", offset=4, length=8, total=17)
    assert bm.prefill_allocate(c).block_ids == [0, 1, 2, 3, 9]
    assert c.num_computed_tokens == 16
    d = _image_request("d", "hashB", offset=4, length=8, total=17)
    assert bm.prefill_allocate(d).block_ids == [0, 5, 6, 7, 10]
    assert ref_counts(bm)[:11] == [4, 2, 2, 2, 1, 2, 2, 2, 1, 1, 1]


def test_c12_image_at_the_start_shares_nothing():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = _image_request("a", "hashA", offset=0, length=6, total=9)
    b = _image_request("b", "hashB", offset=0, length=6, total=9)
    bm.prefill_allocate(a)
    compute_all(bm, a)
    assert bm.prefill_allocate(b).block_ids == [3, 4, 5]
    assert b.num_computed_tokens == 0


def test_block_hash_keys():
    ids = [151655] * 4
    root = block_hash(None, ids)
    assert root == block_hash(None, list(ids))  # deterministic
    assert len(root) == 16
    assert block_hash(None, ids, [("hashA", 0)]) != root
    assert block_hash(None, ids, [("hashA", 0)]) != block_hash(None, ids, [("hashB", 0)])
    assert block_hash(None, ids, [("hashA", 0)]) != block_hash(None, ids, [("hashA", 4)])  # place in the run
    assert block_hash(root, ids) != root  # parent chained in
    assert block_hash(None, [1, 23]) != block_hash(None, [12, 3])  # token boundaries kept


def test_freed_cached_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = RequestState("a", list(range(9)))  # blocks 0, 1 full and cached, 2 partial
    assert bm.prefill_allocate(a).block_ids == [0, 1, 2]
    compute_all(bm, a)
    h0, h1 = bm.blocks[0].block_hash, bm.blocks[1].block_hash
    bm.free_request(a)  # queue: 3, 2, 1, 0
    assert bm.num_free_blocks == 4
    assert bm._cached == {h0: 0, h1: 1}
    x = RequestState("x", [100])
    assert bm.prefill_allocate(x).block_ids == [3]  # never-used block, no eviction
    y = RequestState("y", [200])
    assert bm.prefill_allocate(y).block_ids == [2]  # a's uncached tail
    assert bm._cached == {h0: 0, h1: 1}
    z = RequestState("z", [300])
    assert bm.prefill_allocate(z).block_ids == [1]  # evicts h1 (freed before block 0)
    assert bm.blocks[1].block_hash is None
    assert bm._cached == {h0: 0}
    # a's prompt again: only block 0 is still a hit
    bm.free_request(x)
    bm.free_request(y)  # queue: 0, 3, 2
    a2 = RequestState("a2", list(range(9)))
    assert bm.prefill_allocate(a2).block_ids == [0, 3, 2]
    assert a2.num_computed_tokens == 4


def test_eviction_of_a_cached_block_by_a_decode_append():
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    a = RequestState("a", list(range(4)))
    bm.prefill_allocate(a)  # block 0
    a.token_ids.append(4)
    bm.decode_append(a)  # block 1
    compute_all(bm, a)
    assert bm.blocks[0].block_hash is not None
    h0 = bm.blocks[0].block_hash
    bm.free_request(a)  # queue: 2, 1, 0
    b = RequestState("b", [50, 51, 52, 53])
    assert bm.prefill_allocate(b).block_ids == [2]
    for _ in range(8):
        b.token_ids.append(0)
        bm.decode_append(b)
    assert b.block_table.block_ids == [2, 1, 0]
    assert bm.blocks[0].block_hash is None
    assert h0 not in bm._cached


def test_can_allocate_counts_hits_on_free_cached_blocks_as_used():
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    a = RequestState("a", list(range(8)))
    bm.prefill_allocate(a)
    compute_all(bm, a)
    bm.free_request(a)  # queue: 2, 1, 0 with 1 and 0 cached
    x = RequestState("x", [100])
    assert bm.prefill_allocate(x).block_ids == [2]
    # 12 tokens: hits 0, 1 (both free), plus 1 fresh block; the only free blocks ARE the hits
    b = RequestState("b", list(range(12)))
    assert bm.num_free_blocks == 2
    assert bm.can_allocate(b) is False
    before = snapshot(bm, [x, b])
    with pytest.raises(NoFreeBlocksError):
        bm.prefill_allocate(b)
    assert snapshot(bm, [x, b]) == before
    assert b.num_computed_tokens == 0
    # one fresh block more and it fits, with exact ids
    bm.free_request(x)
    assert bm.can_allocate(b) is True
    assert bm.prefill_allocate(b).block_ids == [0, 1, 2]
    assert b.num_computed_tokens == 8
    assert ref_counts(bm) == [1, 1, 1]


def test_can_allocate_counts_hits_on_live_blocks_as_free_of_charge():
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    a = RequestState("a", list(range(8)))
    assert bm.prefill_allocate(a).block_ids == [0, 1]
    compute_all(bm, a)
    b = RequestState("b", list(range(9)))  # 3 blocks, 2 of them live hits, 1 free block
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(b) is True
    assert bm.prefill_allocate(b).block_ids == [0, 1, 2]
    assert ref_counts(bm) == [2, 2, 1]
    assert bm.num_free_blocks == 0
    c = RequestState("c", list(range(9)))  # 2 live hits but no block for the third
    assert bm.can_allocate(c) is False
    with pytest.raises(NoFreeBlocksError):
        bm.prefill_allocate(c)
    assert ref_counts(bm) == [2, 2, 1]


def test_can_allocate_with_a_mix_of_live_and_free_hits():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = RequestState("a", [1, 2, 3, 4, 5, 6])  # 3 full blocks
    assert bm.prefill_allocate(a).block_ids == [0, 1, 2]
    compute_all(bm, a)
    keep = RequestState("keep", [1, 2, 3])  # holds block 0 live
    assert bm.prefill_allocate(keep).block_ids == [0, 3]
    bm.free_request(a)  # blocks 2, 1 free but cached; block 0 live (keep)
    assert ref_counts(bm) == [1, 0, 0, 1]
    assert bm.num_free_blocks == 2
    # 7 tokens: 4 blocks; hits 0 (live), 1, 2 (free) -> needs 1 fresh, 2 free minus 2 hits = 0
    b = RequestState("b", [1, 2, 3, 4, 5, 6, 7])
    assert bm.can_allocate(b) is False
    # 6 tokens: 3 blocks, hits 0 (live), 1 (free); block 2 holds the last token -> 1 fresh, 2 - 1 = 1
    c = RequestState("c", [1, 2, 3, 4, 5, 6])
    assert bm.can_allocate(c) is True
    assert bm.prefill_allocate(c).block_ids == [0, 1, 2]  # fresh block is 2: its hash evicted
    assert c.num_computed_tokens == 4
    assert bm.blocks[2].block_hash is None
    assert ref_counts(bm) == [2, 1, 1, 1]
