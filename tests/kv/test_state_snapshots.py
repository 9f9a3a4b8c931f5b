"""State snapshots of hybrid models under prefix caching (mm_kv_cache_management/state_snapshots.py
with BlockManager(state_snapshots=...)): a hit stops at the last cached block that has a
snapshot and restores it into the request's fresh slot; snapshots are reserved per prefill
chunk at every interval boundary, valid only once their block is registered; a block's
eviction drops its snapshot; the pool is bounded (least recently used out)."""

import pytest
import torch

from helpers import make_req
from mm_kv_cache_management import BlockManager, StateCache, StateSpec
from mm_kv_cache_management.state_snapshots import StateSnapshotPool

pytestmark = pytest.mark.text
SPEC = StateSpec(num_layers=2, conv_dim=8, conv_kernel=4, num_v_heads=2, k_head_dim=4, v_head_dim=4)
BS, INTERVAL = 4, 8


def manager(num_blocks=32, num_snapshots=4, slots=3):
    pool = StateSnapshotPool(SPEC, num_snapshots, INTERVAL, BS)
    return BlockManager(num_blocks, BS, enable_prefix_caching=True, state_cache=StateCache(SPEC, slots),
                        state_snapshots=pool), pool


def prefill(bm, req, chunk: int, fill=None):
    """Compute ``req``'s prompt in chunks of ``chunk`` as the engine would; ``fill(slot, k)``
    writes a recognisable state into each reserved snapshot (what the forward does)."""
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        bm.reserve_snapshots([(req, n)])
        for k, slot, _ in req.snapshot_points:
            bm.state_snapshots.storage.recurrent[:, slot] = float(req.num_computed_tokens + k)
        bm.commit_computed(req, n)


def test_reserve_marks_every_boundary_the_chunk_crosses():
    bm, pool = manager()
    a = make_req("a", 30)
    bm.prefill_allocate(a)
    bm.reserve_snapshots([(a, 20)])  # tokens 0..19: boundaries 8 and 16
    assert [(k, h) for k, _, h in a.snapshot_points] == [(8, a.block_hashes(BS)[1]), (16, a.block_hashes(BS)[3])]
    assert len(pool) == 0  # pending until committed
    bm.commit_computed(a, 20)
    assert a.snapshot_points == [] and len(pool) == 2
    bm.reserve_snapshots([(a, 1)])  # a one-token chunk never snapshots
    assert a.snapshot_points == []


def test_hit_stops_at_the_last_snapshot_and_restores_it():
    bm, pool = manager()
    a = make_req("a", 22)
    bm.prefill_allocate(a)
    prefill(bm, a, chunk=6)  # boundaries 8, 16 (in chunks 6..11 and 12..17)
    assert len(pool) == 2
    b = make_req("b", 30)  # same first 22 tokens: KV hits cover 5 blocks (20 tokens)
    bm.prefill_allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == 16  # the snapshot at 16, not 20
    assert torch.all(bm.state_cache.recurrent[:, b.state_slot] == 16.0)
    assert (pool.hits, pool.queries) == (1, 2)


def test_no_snapshot_means_no_hit():
    bm, pool = manager()
    a = make_req("a", 7)  # shorter than one interval: no snapshot
    bm.prefill_allocate(a)
    prefill(bm, a, chunk=7)
    b = make_req("b", 12)
    bm.prefill_allocate(b)
    assert b.num_computed_tokens == 0 and len(pool) == 0
    assert torch.all(bm.state_cache.recurrent[:, b.state_slot] == 0)  # a zeroed slot


def test_eviction_of_the_block_drops_its_snapshot():
    bm, pool = manager(num_blocks=6)
    a = make_req("a", 10)
    bm.prefill_allocate(a)
    prefill(bm, a, chunk=10)
    assert len(pool) == 1
    bm.free_request(a)
    other = make_req("x", 24, start=500)  # takes all 6 blocks: every cached block of a evicted
    bm.prefill_allocate(other)
    assert len(pool) == 0
    bm.free_request(other)
    again = make_req("a2", 10)
    bm.prefill_allocate(again)
    assert again.num_computed_tokens == 0


def test_pool_is_bounded_least_recently_used_out():
    bm, pool = manager(num_snapshots=2)
    a = make_req("a", 26)  # boundaries 8, 16, 24: three snapshots into two slots
    bm.prefill_allocate(a)
    prefill(bm, a, chunk=8)  # one boundary per chunk: the oldest snapshot goes for the third
    hashes = a.block_hashes(BS)
    assert len(pool) == 2 and hashes[1] not in pool and hashes[3] in pool and hashes[5] in pool
    c = make_req("c", 26, start=900)
    bm.prefill_allocate(c)
    prefill(bm, c, chunk=26)  # three boundaries in one chunk, two slots: the first two, none pending evicted
    hashes = c.block_hashes(BS)
    assert len(pool) == 2 and hashes[1] in pool and hashes[3] in pool and hashes[5] not in pool


def test_a_pending_snapshot_of_a_step_that_never_committed_is_forgotten():
    bm, pool = manager(num_snapshots=1)
    a, b = make_req("a", 12), make_req("b", 12, start=300)
    bm.prefill_allocate(a)
    bm.prefill_allocate(b)
    bm.reserve_snapshots([(a, 12)])
    assert len(a.snapshot_points) == 1
    bm.reserve_snapshots([(b, 12)])  # a's step raised: its pending slot is reused
    assert len(b.snapshot_points) == 1 and a.snapshot_points[0][1] == b.snapshot_points[0][1]


def test_pool_and_interval_are_checked():
    with pytest.raises(ValueError, match="multiple of the block size"):
        StateSnapshotPool(SPEC, 2, 6, 4)
    with pytest.raises(ValueError, match="max_state_snapshots"):
        StateSnapshotPool(SPEC, 0, 8, 4)
    with pytest.raises(ValueError, match="without prefix caching"):
        BlockManager(8, 4, enable_prefix_caching=True, state_cache=StateCache(SPEC, 1))
    assert StateSnapshotPool(SPEC, 3, 8, 4).nbytes == 3 * SPEC.bytes_per_seq
