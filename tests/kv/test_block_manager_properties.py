"""MAC-3 as a property: random allocate / decode-append / free sequences keep the BlockManager's
books exact, with and without prefix caching.

A reference model of the LRU free queue predicts the exact block ids of every allocation; the
invariants below are checked after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mm_kv_cache_management import BlockManager, PlaceholderRange, NoFreeBlocksError, RequestState, media_items

pytestmark = pytest.mark.text

PAD = 151655


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def content_key(req: RequestState, i: int, bs: int) -> tuple:
    """What decides the K/V of block ``i``: every token up to its end and the images among them."""
    end = (i + 1) * bs
    spans = tuple((s.offset, s.length, s.content_hash) for s in req.mm_positions if s.offset < end)
    return tuple(req.token_ids[:end]), spans


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.one_of(st.integers(4, 8), st.integers(4, 40)),
        block_size=st.sampled_from([1, 2, 4, 16]),
        prefix_caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.bs = block_size
        self.live: list[RequestState] = []
        self.freed: list[RequestState] = []
        self.model_free: list[int] = list(range(num_blocks))  # reference LRU queue, front = next out
        self.counter = 0

    # ---- helpers --------------------------------------------------------------------------
    def _state(self):
        bm = self.bm
        return (
            list(bm._free),
            [(b.ref_count, b.block_hash) for b in bm.blocks],
            dict(bm._cached),
            [
                (
                    r.request_id,
                    None if r.block_table is None else (list(r.block_table.block_ids), r.block_table.num_tokens),
                    r.num_computed_tokens,
                    r.num_cached_tokens,
                )
                for r in self.live + self.freed
            ],
        )

    def _compute(self, req: RequestState, upto: int | None = None) -> None:
        """The runner wrote K/V of tokens up to ``upto`` (all by default): full blocks become cacheable."""
        upto = req.num_tokens if upto is None else upto
        req.num_computed_tokens = upto
        req.block_table.num_tokens = upto
        self.bm.cache_full_blocks(req)

    # ---- rules ----------------------------------------------------------------------------
    @rule(
        length=st.one_of(st.integers(1, 12), st.integers(1, 80)),
        family=st.integers(0, 1),
        image=st.sampled_from([None, "hashA", "hashB"]),
        diverge_at=st.one_of(st.none(), st.integers(0, 79)),
        computed=st.floats(0, 1),
    )
    def allocate(self, length, family, image, diverge_at, computed):
        # requests of one family share a prefix (until diverge_at), so prefix hits happen
        ids = [1000 * family + i for i in range(length)]
        spans = []
        if image is not None and length >= 10:
            off, n = 2, 8  # an image's pad count is fixed by its content
            ids[off : off + n] = [PAD] * n
            spans = [PlaceholderRange(off, n, image)]
        if diverge_at is not None and diverge_at < length:
            ids[diverge_at] = -1 - self.counter
        self._admit(ids, spans, computed)

    @rule(data=st.data(), extra=st.integers(-8, 8), computed=st.floats(0, 1), other_image=st.booleans())
    def resubmit(self, data, extra, computed, other_image):
        """A prompt seen before (its blocks may sit free but cached, or be live), cut or
        extended; with ``other_image`` the same text and pad ids with a different picture (C12)."""
        pool = self.freed + self.live
        if not pool:
            return
        old = data.draw(st.sampled_from(pool))
        ids = old.token_ids[: max(1, old.num_tokens + extra)] + [7] * max(0, extra)
        spans = [s for s in old.mm_positions if s.offset + s.length <= len(ids)]
        if other_image:
            swap = {"hashA": "hashB", "hashB": "hashA"}
            spans = [PlaceholderRange(s.offset, s.length, swap[s.content_hash]) for s in spans]
        self._admit(ids, spans, computed)

    def _admit(self, ids, spans, computed):
        length = len(ids)
        self.counter += 1
        req = RequestState(f"r{self.counter}", ids, mm_features=media_items(spans))

        hashes = req.block_hashes(self.bs, length - 1)
        expected_hits = []
        if self.bm.enable_prefix_caching:
            for h in hashes:
                if h not in self.bm._cached:
                    break
                expected_hits.append(self.bm._cached[h])
        expected_fresh = ceil_div(length, self.bs) - len(expected_hits)
        free_after_hits = [b for b in self.model_free if b not in expected_hits]
        fits = expected_fresh <= len(free_after_hits)

        if expected_hits:
            event("prefix hit")
        if any(self.bm.blocks[b].ref_count == 0 for b in expected_hits):
            event("hit on a free cached block")
            if expected_fresh <= len(self.model_free) and not fits:
                event("free cached hits decide can_allocate")
        can = self.bm.can_allocate(req)
        assert can is fits
        before = self._state()
        if not fits:
            with pytest.raises(NoFreeBlocksError):
                self.bm.prefill_allocate(req)
            assert self._state() == before
            assert req.block_table is None
            event("prefill refused")
            return
        table = self.bm.prefill_allocate(req)
        assert table.block_ids == expected_hits + free_after_hits[:expected_fresh]
        assert req.num_computed_tokens == req.num_cached_tokens == len(expected_hits) * self.bs
        assert req.num_computed_tokens < length  # the last prompt token is always computed (C11)
        self.model_free = free_after_hits[expected_fresh:]
        self.live.append(req)
        # chunked prefill: only part of the prompt may be computed so far
        cached = req.num_computed_tokens
        self._compute(req, cached + int(computed * (length - cached)))

    @rule(data=st.data())
    def compute(self, data):
        """The rest of a request's prefill runs."""
        if not self.live:
            return
        self._compute(data.draw(st.sampled_from(self.live)))

    @rule(data=st.data(), token=st.integers(0, 5))
    def decode(self, data, token):
        if not self.live:
            return
        req = data.draw(st.sampled_from(self.live))
        held = list(req.block_table.block_ids)
        req.token_ids.append(token)
        pos = req.num_tokens - 1
        at_boundary = pos % self.bs == 0
        assert at_boundary is (pos == len(held) * self.bs)
        before = self._state()
        if at_boundary and not self.model_free:
            with pytest.raises(NoFreeBlocksError):
                self.bm.decode_append(req)
            assert self._state() == before
            req.token_ids.pop()  # the scheduler would preempt; the token is not kept
            event("decode refused")
            return
        slot = self.bm.decode_append(req)
        if at_boundary:
            assert req.block_table.block_ids == held + [self.model_free.pop(0)]
        else:
            assert req.block_table.block_ids == held
        assert slot == req.block_table.block_ids[pos // self.bs] * self.bs + pos % self.bs
        assert req.block_table.num_tokens == req.num_tokens
        self._compute(req)  # decode follows a finished prefill: every token is computed

    @rule(data=st.data(), twice=st.booleans())
    def free(self, data, twice):
        if not self.live:
            return
        req = data.draw(st.sampled_from(self.live))
        blocks = list(req.block_table.block_ids)
        others = [b for r in self.live if r is not req for b in r.block_table.block_ids]
        self.bm.free_request(req)
        self.model_free += [b for b in reversed(blocks) if b not in others]
        self.live.remove(req)
        self.freed.append(req)
        assert req.block_table is None
        if twice:
            state = self._state()
            self.bm.free_request(req)
            assert self._state() == state

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        if not hasattr(self, "bm"):
            return
        bm, bs = self.bm, self.bs
        holders: dict[int, list[tuple[RequestState, int]]] = {}
        for r in self.live:
            t = r.block_table
            assert t is not None
            assert len(t.block_ids) == ceil_div(r.num_tokens, bs)
            assert len(set(t.block_ids)) == len(t.block_ids)
            for i, b in enumerate(t.block_ids):
                holders.setdefault(b, []).append((r, i))
        for r in self.freed:
            assert r.block_table is None
        total_holdings = sum(len(r.block_table.block_ids) for r in self.live)
        assert sum(b.ref_count for b in bm.blocks) == total_holdings
        for b in bm.blocks:
            held_by = holders.get(b.block_id, [])
            assert b.ref_count == len(held_by)
            if len(held_by) > 1:
                assert bm.enable_prefix_caching
                assert b.block_hash is not None  # only computed, registered blocks are shared
                event("block shared")
                # independent of the hash function: every holder has the same tokens and the
                # same images up to the end of the shared block (C12)
                assert len({content_key(r, i, bs) for r, i in held_by}) == 1
            for r, i in held_by:
                # a registered block holds exactly this request's block i (C12: no wrong sharing)
                # and only blocks whose K/V every holder has (computed or served from the cache)
                if b.block_hash is not None:
                    assert (i + 1) * bs <= r.num_computed_tokens
                    assert r.block_hashes(bs)[i] == b.block_hash
        if not bm.enable_prefix_caching:
            assert all(len(h) <= 1 for h in holders.values())
            assert bm._cached == {}
        zero = [b.block_id for b in bm.blocks if b.ref_count == 0]
        assert bm.num_free_blocks == len(zero)
        assert list(bm._free) == self.model_free
        assert sorted(self.model_free) == zero
        for h, block_id in bm._cached.items():
            assert bm.blocks[block_id].block_hash == h
        assert sum(b.block_hash is not None for b in bm.blocks) == len(bm._cached)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for r in list(self.live):
            self.bm.free_request(r)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
