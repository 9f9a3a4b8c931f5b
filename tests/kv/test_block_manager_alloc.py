"""BlockManager accounting, in the style of vLLM's block pool tests: exact block ids, exact
reference counts, exact free counts (MAC-3, MAC-4 at the bookkeeping level). This file:
construction, LRU order of block ids, prefill, decode, free, and case C10; prefix caching
(C11, C12) is in test_block_manager_prefix.py."""

from __future__ import annotations

import pytest

from helpers import compute_all, make_req, ref_counts, snapshot
from mm_kv_cache_management import BlockManager, NoFreeBlocksError

pytestmark = pytest.mark.text


# ---- construction -------------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks", [0, -1, -16])
def test_constructor_rejects_num_blocks_below_one(num_blocks):
    with pytest.raises(ValueError, match=f"num_blocks must be >= 1, got {num_blocks}"):
        BlockManager(num_blocks, 16)


@pytest.mark.parametrize("block_size", [0, -1])
def test_constructor_rejects_block_size_below_one(block_size):
    with pytest.raises(ValueError, match=f"block_size must be >= 1, got {block_size}"):
        BlockManager(4, block_size)


def test_fresh_manager_state():
    bm = BlockManager(5, 16)
    assert bm.num_blocks == 5
    assert bm.block_size == 16
    assert bm.enable_prefix_caching is False
    assert bm.num_free_blocks == 5
    assert [b.block_id for b in bm.blocks] == [0, 1, 2, 3, 4]
    assert ref_counts(bm) == [0, 0, 0, 0, 0]
    assert [b.block_hash for b in bm.blocks] == [None] * 5


def test_one_block_manager_is_valid():
    bm = BlockManager(1, 1)
    r = make_req("a", 1)
    assert bm.prefill_allocate(r).block_ids == [0]
    assert bm.num_free_blocks == 0


# ---- LRU order of block ids ---------------------------------------------------------------
def test_fresh_manager_hands_out_ids_in_order():
    bm = BlockManager(8, 4)
    a, b, c = make_req("a", 3), make_req("b", 9, 100), make_req("c", 4, 200)
    assert bm.prefill_allocate(a).block_ids == [0]
    assert bm.prefill_allocate(b).block_ids == [1, 2, 3]
    assert bm.prefill_allocate(c).block_ids == [4]
    assert ref_counts(bm) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3


def test_freed_blocks_go_to_the_back_tail_first():
    bm = BlockManager(8, 4)
    a, b = make_req("a", 10), make_req("b", 5, 100)
    assert bm.prefill_allocate(a).block_ids == [0, 1, 2]
    assert bm.prefill_allocate(b).block_ids == [3, 4]
    bm.free_request(a)
    assert ref_counts(bm) == [0, 0, 0, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 6
    # queue: never-used 5, 6, 7, then a's blocks tail first: 2, 1, 0
    c = make_req("c", 24, 200)
    assert bm.prefill_allocate(c).block_ids == [5, 6, 7, 2, 1, 0]
    assert bm.num_free_blocks == 0
    bm.free_request(b)  # queue: 4, 3
    bm.free_request(c)  # queue: 4, 3, 0, 1, 2, 7, 6, 5
    d = make_req("d", 32, 300)
    assert bm.prefill_allocate(d).block_ids == [4, 3, 0, 1, 2, 7, 6, 5]


def test_lru_order_across_interleaved_frees():
    bm = BlockManager(6, 2)
    reqs = [make_req(f"r{i}", 2, 10 * i) for i in range(6)]
    for i, r in enumerate(reqs):
        assert bm.prefill_allocate(r).block_ids == [i]
    for i in (3, 0, 5):
        bm.free_request(reqs[i])
    assert bm.num_free_blocks == 3
    assert ref_counts(bm) == [0, 1, 1, 0, 1, 0]
    x = make_req("x", 5, 100)  # 3 blocks: oldest freed first
    assert bm.prefill_allocate(x).block_ids == [3, 0, 5]


# ---- prefill ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "length, num_blocks_held",
    [(1, 1), (15, 1), (16, 1), (17, 2), (31, 2), (32, 2), (33, 3), (100, 7)],
)
def test_prefill_allocates_ceil_blocks(length, num_blocks_held):
    bm = BlockManager(10, 16)
    r = make_req("a", length)
    assert bm.num_blocks_needed(length) == num_blocks_held
    assert bm.can_allocate(r) is True
    table = bm.prefill_allocate(r)
    assert r.block_table is table
    assert table.block_size == 16
    assert table.block_ids == list(range(num_blocks_held))
    assert table.capacity == 16 * num_blocks_held
    assert r.num_computed_tokens == 0 and r.num_cached_tokens == 0
    assert bm.num_free_blocks == 10 - num_blocks_held
    assert ref_counts(bm) == [1] * num_blocks_held + [0] * (10 - num_blocks_held)
    # the last prompt token's slot lies in the last block
    last = table.slot(length - 1)
    assert last == table.block_ids[-1] * 16 + (length - 1) % 16
    bm.free_request(r)
    assert bm.num_free_blocks == 10
    assert ref_counts(bm) == [0] * 10


def test_prefill_on_a_request_that_holds_blocks_raises_and_changes_nothing():
    bm = BlockManager(6, 4)
    a, b = make_req("a", 6), make_req("b", 3, 50)
    table = bm.prefill_allocate(a)
    bm.prefill_allocate(b)
    before = snapshot(bm, [a, b])
    with pytest.raises(ValueError, match="'a' already holds blocks"):
        bm.prefill_allocate(a)
    assert snapshot(bm, [a, b]) == before
    assert a.block_table is table
    assert table.block_ids == [0, 1]


def test_prefill_without_enough_blocks_raises_and_changes_nothing():
    bm = BlockManager(4, 4)
    a = make_req("a", 7)
    assert bm.prefill_allocate(a).block_ids == [0, 1]
    b = make_req("b", 9, 100)  # needs 3, 2 free
    assert bm.can_allocate(b) is False
    before = snapshot(bm, [a, b])
    with pytest.raises(NoFreeBlocksError, match=r"'b' needs 3 blocks for 9 tokens, only 2 free"):
        bm.prefill_allocate(b)
    assert snapshot(bm, [a, b]) == before
    assert b.block_table is None
    assert a.block_table.block_ids == [0, 1]
    assert ref_counts(bm) == [1, 1, 0, 0]
    assert bm.num_free_blocks == 2
    # an exact fit still goes through afterwards
    c = make_req("c", 8, 200)
    assert bm.can_allocate(c) is True
    assert bm.prefill_allocate(c).block_ids == [2, 3]
    assert bm.num_free_blocks == 0


def test_prefill_larger_than_the_whole_cache_is_refused():
    bm = BlockManager(3, 16)
    r = make_req("a", 49)
    assert bm.can_allocate(r) is False
    with pytest.raises(NoFreeBlocksError):
        bm.prefill_allocate(r)
    assert bm.num_free_blocks == 3
    assert r.block_table is None


# ---- decode -------------------------------------------------------------------------------
def test_decode_append_adds_a_block_only_at_a_boundary():
    bm = BlockManager(8, 4)
    a, b = make_req("a", 4), make_req("b", 4, 100)
    assert bm.prefill_allocate(a).block_ids == [0]
    assert bm.prefill_allocate(b).block_ids == [1]
    expected = [  # (request, slot, a's blocks, b's blocks, free)
        (a, 8, [0, 2], [1], 5),  # token 4 of a: boundary -> block 2
        (b, 12, [0, 2], [1, 3], 4),  # token 4 of b: boundary -> block 3
        (a, 9, [0, 2], [1, 3], 4),
        (a, 10, [0, 2], [1, 3], 4),
        (b, 13, [0, 2], [1, 3], 4),
        (a, 11, [0, 2], [1, 3], 4),
        (a, 16, [0, 2, 4], [1, 3], 3),  # token 8 of a: boundary -> block 4
    ]
    for req, slot, a_blocks, b_blocks, free in expected:
        req.token_ids.append(7)
        assert bm.decode_append(req) == slot
        assert req.block_table.num_tokens == req.num_tokens
        assert a.block_table.block_ids == a_blocks
        assert b.block_table.block_ids == b_blocks
        assert bm.num_free_blocks == free
    assert ref_counts(bm) == [1, 1, 1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_decode_append_block_count_follows_ceil(block_size):
    bm = BlockManager(64, block_size)
    r = make_req("a", 1)
    bm.prefill_allocate(r)
    for n in range(2, 40):
        held = len(r.block_table.block_ids)
        r.token_ids.append(n)
        slot = bm.decode_append(r)
        assert len(r.block_table.block_ids) == -(-n // block_size)
        assert len(r.block_table.block_ids) - held == (1 if (n - 1) % block_size == 0 else 0)
        assert slot == r.block_table.block_ids[(n - 1) // block_size] * block_size + (n - 1) % block_size
        assert bm.num_free_blocks == 64 - len(r.block_table.block_ids)
    assert r.block_table.block_ids == list(range(-(-39 // block_size)))


def test_decode_append_without_blocks_raises():
    bm = BlockManager(4, 4)
    r = make_req("a", 3)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.decode_append(r)
    assert bm.num_free_blocks == 4


def test_decode_append_without_a_free_block_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    a, b = make_req("a", 4), make_req("b", 4, 100)
    bm.prefill_allocate(a)
    bm.prefill_allocate(b)
    compute_all(bm, a)
    compute_all(bm, b)
    a.token_ids.append(99)
    before = snapshot(bm, [a, b])
    with pytest.raises(NoFreeBlocksError, match="token 4 of request 'a'"):
        bm.decode_append(a)
    assert snapshot(bm, [a, b]) == before
    assert a.block_table.block_ids == [0] and a.block_table.num_tokens == 4
    assert b.block_table.block_ids == [1]
    # once b is gone the same append goes through, into b's old block
    bm.free_request(b)
    assert bm.decode_append(a) == 4
    assert a.block_table.block_ids == [0, 1]
    assert bm.num_free_blocks == 0


def test_decode_append_within_a_block_needs_no_free_block():
    bm = BlockManager(1, 4)
    r = make_req("a", 2)
    bm.prefill_allocate(r)
    assert bm.num_free_blocks == 0
    r.token_ids.append(5)
    assert bm.decode_append(r) == 2
    r.token_ids.append(6)
    assert bm.decode_append(r) == 3
    r.token_ids.append(7)
    with pytest.raises(NoFreeBlocksError):
        bm.decode_append(r)
    assert r.block_table.block_ids == [0]


def test_decode_append_after_several_tokens_reserves_every_missing_block():
    # regression: a jump of more than one block used to append one block, bump num_tokens,
    # then raise IndexError from BlockTable.slot with the manager already changed
    bm = BlockManager(8, 4)
    r = make_req("a", 4)
    bm.prefill_allocate(r)
    r.token_ids += [1, 2, 3, 4, 5]  # 9 tokens: 3 blocks
    assert bm.decode_append(r) == 2 * 4 + 0
    assert r.block_table.block_ids == [0, 1, 2]
    assert r.block_table.num_tokens == 9
    assert bm.num_free_blocks == 5


def test_decode_append_of_several_missing_blocks_is_all_or_nothing():
    bm = BlockManager(2, 4)
    r = make_req("a", 4)
    bm.prefill_allocate(r)
    r.token_ids += list(range(9))  # 13 tokens: 4 blocks, 3 missing, 1 free
    before = snapshot(bm, [r])
    with pytest.raises(NoFreeBlocksError, match="needs 3, 1 free"):
        bm.decode_append(r)
    assert snapshot(bm, [r]) == before


# ---- free ---------------------------------------------------------------------------------
def test_free_request_is_idempotent():
    bm = BlockManager(6, 4)
    a, b = make_req("a", 9), make_req("b", 2, 100)
    bm.prefill_allocate(a)
    bm.prefill_allocate(b)
    a.num_computed_tokens = 9
    bm.free_request(a)
    assert a.block_table is None
    assert a.num_computed_tokens == 0
    after_first = snapshot(bm, [a, b])
    assert after_first[0] == 5
    assert ref_counts(bm) == [0, 0, 0, 1, 0, 0]
    bm.free_request(a)
    assert snapshot(bm, [a, b]) == after_first
    # a request that never held blocks
    bm.free_request(make_req("never", 5, 500))
    assert snapshot(bm, [a, b]) == after_first
    # the freed request can be admitted again
    assert bm.prefill_allocate(a).block_ids == [4, 5, 2]


def test_free_count_returns_to_start_after_mixed_traffic():
    bm = BlockManager(10, 4)
    reqs = [make_req(f"r{i}", n, 100 * i) for i, n in enumerate([1, 5, 8, 12])]
    for r in reqs:
        bm.prefill_allocate(r)
    assert bm.num_free_blocks == 10 - (1 + 2 + 2 + 3)
    for r in reqs:
        for _ in range(3):
            r.token_ids.append(0)
            bm.decode_append(r)
    for r in reqs:
        bm.free_request(r)
    assert bm.num_free_blocks == 10
    assert ref_counts(bm) == [0] * 10


# ---- handed case C10 ----------------------------------------------------------------------
def test_c10_exact_boundary_prompts():
    bm = BlockManager(16, 16)
    r16, r32 = make_req("r16", 16), make_req("r32", 32, 1000)
    bm.prefill_allocate(r16)
    bm.prefill_allocate(r32)
    assert [len(r16.block_table.block_ids), len(r32.block_table.block_ids)] == [1, 2]
    assert r16.block_table.block_ids == [0]
    assert r32.block_table.block_ids == [1, 2]
    slots = []
    for r in (r16, r32):
        r.token_ids.append(42)  # the sampled token
        slots.append(bm.decode_append(r))
    assert [len(r16.block_table.block_ids), len(r32.block_table.block_ids)] == [2, 3]
    assert r16.block_table.block_ids == [0, 3]
    assert r32.block_table.block_ids == [1, 2, 4]
    assert slots == [3 * 16 + 0, 4 * 16 + 0]
    assert bm.num_free_blocks == 16 - 5
    bm.free_request(r16)
    bm.free_request(r32)
    assert bm.num_free_blocks == 16
