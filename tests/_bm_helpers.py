"""Shared helpers for the BlockManager accounting tests (test_block_manager_alloc.py,
test_block_manager_prefix.py)."""

from __future__ import annotations

from mm_kv_cache_management import BlockManager, RequestState


def make_req(rid: str, num_tokens: int, start: int = 0, image_spans=None) -> RequestState:
    """A request whose token ids are ``start, start+1, ...`` (distinct starts: no shared prefix)."""
    return RequestState(rid, list(range(start, start + num_tokens)), image_spans=list(image_spans or []))


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def snapshot(bm: BlockManager, reqs) -> tuple:
    """Everything an allocation could touch, by value."""
    return (
        bm.num_free_blocks,
        list(bm._free),
        ref_counts(bm),
        [b.block_hash for b in bm.blocks],
        dict(bm._cached),
        [
            None
            if r.block_table is None
            else (list(r.block_table.block_ids), r.block_table.num_tokens, r.num_computed_tokens, r.num_cached_tokens)
            for r in reqs
        ],
    )


def compute_all(bm: BlockManager, req: RequestState) -> None:
    """What the runner does after a forward pass: every token's K/V now stored, full blocks cached."""
    req.num_computed_tokens = req.num_tokens
    req.block_table.num_tokens = req.num_tokens
    bm.cache_full_blocks(req)
