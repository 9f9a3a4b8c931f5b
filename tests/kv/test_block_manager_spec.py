"""``BlockManager.free_uncomputed_tail``: rejected speculative drafts give back their slots
(blocks left with no computed token freed) and never enter the prefix cache."""

from __future__ import annotations

import pytest

from mm_kv_cache_management import BlockManager, RequestState

pytestmark = pytest.mark.text


def test_rejected_drafts_give_back_their_blocks_and_stay_out_of_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = RequestState("r", list(range(6)))
    bm.prefill_allocate(req)
    bm.commit_computed(req, 6)  # 2 blocks, the first full and cached
    req.token_ids += [100, 101, 102, 103, 104, 105]  # the sampled token + 5 drafts: slots up to 11
    bm.decode_append(req)
    assert len(req.block_table.block_ids) == 3 and bm.num_free_blocks == 5
    del req.token_ids[-5:]  # all drafts rejected; the sampled token (6) and the next one kept
    req.token_ids.append(7)
    bm.commit_computed(req, 1)  # only token 6's K/V are valid
    assert bm.free_uncomputed_tail(req) == 1
    assert len(req.block_table.block_ids) == 2 and req.block_table.num_tokens == 7
    assert bm.num_free_blocks == 6
    assert len(bm._cached) == 1  # the prompt's full block only: no draft hashed
    bm.free_request(req)
    assert bm.num_free_blocks == 8


def test_nothing_past_the_computed_tokens_is_a_no_op_and_no_blocks_is_an_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    req = RequestState("r", list(range(5)))
    bm.prefill_allocate(req)
    bm.commit_computed(req, 5)
    assert bm.free_uncomputed_tail(req) == 0 and len(req.block_table.block_ids) == 2
    bm.free_request(req)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.free_uncomputed_tail(req)
