"""``BlockManager.commit_computed``: the one writer of a request's progress after a forward
(``num_computed_tokens``, ``block_table.num_tokens``, prefix-cache registration)."""

from __future__ import annotations

import pytest

from helpers import make_req, snapshot
from mm_kv_cache_management import BlockManager

pytestmark = pytest.mark.text


def test_commit_computed_advances_progress_and_caches_full_blocks():
    """The scheduler's only way to record a forward: progress, table length and prefix cache."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = make_req("a", 10)
    bm.prefill_allocate(req)
    bm.commit_computed(req, 6)
    assert (req.num_computed_tokens, req.block_table.num_tokens) == (6, 6)
    assert sum(b.block_hash is not None for b in bm.blocks) == 1  # one full computed block
    bm.commit_computed(req, 4)
    assert (req.num_computed_tokens, req.block_table.num_tokens) == (10, 10)
    assert sum(b.block_hash is not None for b in bm.blocks) == 2
    before = snapshot(bm, [req])
    with pytest.raises(ValueError, match="cannot commit 1 tokens after 10"):
        bm.commit_computed(req, 1)  # past the request's tokens
    req.token_ids.extend([1, 2, 3])
    with pytest.raises(ValueError, match="12 slots reserved"):
        bm.commit_computed(req, 3)  # past the reserved slots (decode_append not called)
    with pytest.raises(ValueError, match="cannot commit -1"):
        bm.commit_computed(req, -1)
    assert snapshot(bm, [req]) == before
    bm.free_request(req)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.commit_computed(req, 1)


def test_only_the_kv_package_writes_allocation_state():
    """No module of ``atlas_vlm`` assigns a request's progress or blocks: the scheduler goes
    through ``BlockManager`` (design rule: one owner for each piece of state)."""
    import re

    from helpers import REPO

    write = re.compile(r"\.(num_computed_tokens|num_cached_tokens|block_table|block_ids|num_tokens)\s*[-+]?=(?!=)")
    offenders = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
                 for p in sorted((REPO / "atlas_vlm").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if write.search(line)]
    assert offenders == []
