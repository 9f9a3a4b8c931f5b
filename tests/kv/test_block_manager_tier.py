"""BlockManager with a lower KV tier (the disk tier's interface, faked here without files):
write-through at registration, admission walking past the in-memory hits into the tier
(chained: stops at the first miss; never the block of the last prompt token), loaded blocks
counted as cached and registered in memory; for a hybrid model, snapshots written beside their
blocks and a disk hit ending at the last block with a loadable snapshot."""

from __future__ import annotations

import pytest

from helpers import compute_all, make_req
from mm_kv_cache_management import BlockManager

pytestmark = pytest.mark.text


class FakeTier:
    """Block contents are modelled by the hash a block was computed / loaded for."""

    def __init__(self, bm_blocks: int):
        self.store: dict[bytes, bytes] = {}  # hash -> the "K/V" saved (the hash it was computed for)
        self.content: dict[int, bytes] = {}  # block id -> what its K/V are
        self.saves: list[bytes] = []
        self.loads: list[tuple[bytes, int]] = []

    def save(self, block_hash: bytes, block_id: int) -> bool:
        self.saves.append(block_hash)
        if block_hash in self.store:
            return False
        self.store[block_hash] = block_hash
        return True

    def load(self, block_hash: bytes, block_id: int) -> bool:
        self.loads.append((block_hash, block_id))
        if block_hash not in self.store:
            return False
        self.content[block_id] = self.store[block_hash]
        return True


def run(bm: BlockManager, req) -> None:
    bm.prefill_allocate(req)
    compute_all(bm, req)
    bm.free_request(req)


def test_blocks_are_written_through_once_when_registered():
    tier = FakeTier(8)
    bm = BlockManager(8, 4, enable_prefix_caching=True, kv_tier=tier)
    a = make_req("a", 10)
    run(bm, a)
    assert tier.saves == a.block_hashes(4)  # 2 full blocks, each saved once
    run(bm, make_req("a2", 10))  # same tokens: memory hit on block 0; block 1 recomputed, already registered
    assert tier.saves == a.block_hashes(4)


def test_admission_loads_from_the_tier_after_memory_hits_end():
    tier = FakeTier(4)
    bm = BlockManager(4, 4, enable_prefix_caching=True, kv_tier=tier)
    a = make_req("a", 13)  # 3 full blocks, 4 blocks in all
    run(bm, a)
    hashes = a.block_hashes(4)
    run(bm, make_req("b", 16, start=100))  # takes every block: a's blocks leave memory
    assert not any(h in bm._cached for h in hashes)
    a2 = make_req("a2", 13)
    table = bm.prefill_allocate(a2)
    # 12 tokens of full blocks; the last prompt token (12) is in block 3, so all 3 full blocks load
    assert a2.num_cached_tokens == a2.num_computed_tokens == 12 == table.num_tokens
    assert [tier.content[b] for b in table.block_ids[:3]] == hashes
    assert all(bm._cached[h] == b for h, b in zip(hashes, table.block_ids))
    compute_all(bm, a2)
    bm.free_request(a2)
    a3 = make_req("a3", 13)  # now a memory hit, no tier load
    n_loads = len(tier.loads)
    bm.prefill_allocate(a3)
    assert a3.num_cached_tokens == 12 and len(tier.loads) == n_loads


def test_the_walk_stops_at_the_first_miss_and_spares_the_last_token():
    tier = FakeTier(8)
    bm = BlockManager(8, 4, enable_prefix_caching=True, kv_tier=tier)
    a = make_req("a", 16)  # 4 full blocks: the last prompt token's block never counts (C11)
    run(bm, a)
    hashes = a.block_hashes(4)
    assert [h for h, _ in tier.loads] == hashes[:1]  # the cold run looked once and missed
    del tier.store[hashes[1]]  # block 1 lost: 2 and 3 are unreachable (chained hashes)
    tier.loads.clear()
    bm2 = BlockManager(8, 4, enable_prefix_caching=True, kv_tier=tier)  # a restart: memory empty
    a2 = make_req("a2", 16)
    bm2.prefill_allocate(a2)
    assert a2.num_cached_tokens == 4
    assert [h for h, _ in tier.loads] == hashes[:2]
    tier.store[hashes[1]] = hashes[1]
    bm3 = BlockManager(8, 4, enable_prefix_caching=True, kv_tier=tier)
    a3 = make_req("a3", 16)
    bm3.prefill_allocate(a3)
    assert a3.num_cached_tokens == 12  # blocks 0-2; block 3 holds token 15, the last one
    a4 = make_req("a4", 17)
    bm4 = BlockManager(8, 4, enable_prefix_caching=True, kv_tier=tier)
    bm4.prefill_allocate(a4)
    assert a4.num_cached_tokens == 16


def test_a_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(4, 4, enable_prefix_caching=False, kv_tier=FakeTier(4))


# ---- a hybrid model: state snapshots travel with their blocks ------------------------------------
class FakeSnapshotTier(FakeTier):
    """``FakeTier`` plus the snapshot half of ``KVBlockTier`` over a real ``StateSnapshotPool``."""

    def __init__(self, pool):
        super().__init__(0)
        self.pool = pool
        self.snaps: dict[bytes, tuple] = {}  # hash -> (conv, recurrent) "on disk"
        self.damaged: set[bytes] = set()

    def contains_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self.snaps

    def save_snapshot(self, block_hash: bytes) -> bool:
        if block_hash in self.snaps:
            return False
        self.snaps[block_hash] = tuple(t.clone() for t in self.pool.snapshot(block_hash))
        return True

    def load_snapshot(self, block_hash: bytes) -> bool:
        if block_hash in self.damaged:  # a file is there, but fails its checks: deleted, a miss
            del self.snaps[block_hash]
            return False
        return block_hash in self.snaps and self.pool.put(block_hash, *self.snaps[block_hash])


def hybrid_bm(tier=None):
    from mm_kv_cache_management import StateCache, StateSpec
    from mm_kv_cache_management.state_snapshots import StateSnapshotPool

    spec = StateSpec(num_layers=2, conv_dim=8, conv_kernel=4, num_v_heads=2, k_head_dim=4, v_head_dim=4)
    pool = StateSnapshotPool(spec, num_slots=4, interval=8, block_size=4)
    tier = tier or FakeSnapshotTier(pool)
    tier.pool = pool  # a restart: a new, empty pool over the same "disk"
    return BlockManager(8, 4, enable_prefix_caching=True, kv_tier=tier, state_cache=StateCache(spec, 2),
                        state_snapshots=pool), tier


def run_hybrid(bm, req) -> None:
    """Admission, a forward that writes state ``end`` at each snapshot point, commit, free."""
    bm.prefill_allocate(req)
    bm.reserve_snapshots([(req, req.num_tokens - req.num_computed_tokens)])
    for k, slot, _ in req.snapshot_points:
        bm.state_snapshots.storage.conv[:, slot].fill_(req.num_computed_tokens + k)
    compute_all(bm, req)
    bm.free_request(req)


def test_a_snapshot_is_written_beside_its_block_and_a_restart_resumes_from_it():
    bm, tier = hybrid_bm()
    a = make_req("a", 21)  # 5 full blocks before the last token; snapshots at 8 and 16
    run_hybrid(bm, a)
    hashes = a.block_hashes(4)
    assert set(tier.snaps) == {hashes[1], hashes[3]} and set(tier.store) == set(hashes)
    bm, tier = hybrid_bm(tier)  # restart
    b = make_req("b", 21)
    bm.prefill_allocate(b)
    assert b.num_cached_tokens == 16  # block 4 is on disk too, but has no snapshot
    assert [h for h, _ in tier.loads] == hashes[:4]  # no block past the last snapshot file is read
    assert bm.state_cache.conv[:, b.state_slot].eq(16).all()  # the state at token 16, restored
    assert (bm.state_snapshots.hits, bm.state_snapshots.queries) == (1, 1)


def test_a_missing_or_damaged_snapshot_limits_the_hit():
    bm, tier = hybrid_bm()
    a = make_req("a", 21)
    run_hybrid(bm, a)
    hashes = a.block_hashes(4)
    tier.damaged.add(hashes[3])
    bm, tier = hybrid_bm(tier)
    b = make_req("b", 21)
    bm.prefill_allocate(b)
    assert b.num_cached_tokens == 8 and bm.state_cache.conv[:, b.state_slot].eq(8).all()
    assert [h for h, _ in tier.loads] == hashes[:4]  # read up to the damaged snapshot's block ...
    assert hashes[1] in bm._cached and hashes[2] not in bm._cached and hashes[3] not in bm._cached  # ... not kept
    bm, tier = hybrid_bm(tier)
    tier.snaps.clear()  # every block file is there, no snapshot
    tier.loads = []
    c = make_req("c", 21)
    bm.prefill_allocate(c)
    assert c.num_cached_tokens == 0 and not bm._cached and tier.loads == []
    assert bm.state_cache.conv[:, c.state_slot].eq(0).all()
