"""Pure input preparation (no model, no cache): ``prepare_inputs``, ``build_attention_metadata``
and ``image_rows_for_chunk`` on hand-built requests, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm.worker.input_prep import mm_rows_for_chunk, prepare_inputs
from atlas_vlm.layers.attention import build_attention_metadata
from atlas_vlm.request import Request
from mm_kv_cache_management import BlockTable, PlaceholderRange, media_items

pytestmark = pytest.mark.text


def make_req(rid, token_ids, blocks, computed, num_prompt=-1, **kw) -> Request:
    return Request(rid, list(token_ids), num_prompt_tokens=num_prompt,
                   block_table=BlockTable(16, list(blocks), num_tokens=len(token_ids)),
                   num_computed_tokens=computed, **kw)


def expected_mask(query_lens, context_lens):
    """Loop form of the rule: query i of a request sits at c - q + i and sees keys 0..c-q+i;
    padded query rows see key 0 only."""
    max_q, max_c = max(query_lens), max(context_lens)
    mask = torch.zeros(len(query_lens), 1, max_q, max_c, dtype=torch.bool)
    for s, (q, c) in enumerate(zip(query_lens, context_lens)):
        for i in range(max_q):
            if i < q:
                mask[s, 0, i, : c - q + i + 1] = True
            else:
                mask[s, 0, i, 0] = True
    return mask


@pytest.fixture
def mixed_batch():
    """A: a middle prefill chunk (tokens 16..35 of a 40-token prompt, blocks [7, 3, 9]);
    B: a decode (token 20 of 21, blocks [5, 2]); C: a whole 5-token prompt (block [4])."""
    a = make_req("A", range(1000, 1040), [7, 3, 9], computed=16)
    b = make_req("B", range(2000, 2021), [5, 2], computed=20, num_prompt=12)
    c = make_req("C", range(3000, 3005), [4], computed=0)
    return [(a, 20), (b, 1), (c, 5)]


def test_mixed_batch_ids_positions_slots(mixed_batch):
    inp = prepare_inputs(mixed_batch)
    assert inp.input_ids.tolist() == list(range(1016, 1036)) + [2020] + list(range(3000, 3005))
    assert inp.positions.tolist() == list(range(16, 36)) + [20] + list(range(5))
    # A: tokens 16..31 in block 3 (slots 48..63), 32..35 in block 9 (144..147);
    # B: token 20 in block 2 at offset 4 (36); C: block 4 (64..68)
    assert inp.meta.slot_mapping.tolist() == list(range(48, 64)) + list(range(144, 148)) + [36] + list(range(64, 69))
    assert inp.meta.block_tables.tolist() == [[7, 3, 9], [5, 2, 0], [4, 0, 0]]
    assert inp.meta.query_lens == [20, 1, 5]
    assert inp.meta.context_lens == [36, 21, 5]
    # A's chunk does not reach its end: no logits; B's decode token and C's last token do
    assert inp.logits_index.tolist() == [20, 25]
    assert inp.sampled == [1, 2]
    assert inp.mm_embeds is None and inp.mm_token_index is None


def test_mixed_batch_attention_layout(mixed_batch):
    meta = prepare_inputs(mixed_batch).meta
    q_idx = torch.zeros(3, 20, dtype=torch.long)
    q_idx[0] = torch.arange(20)
    q_idx[1, 0] = 20
    q_idx[2, :5] = torch.arange(21, 26)
    assert torch.equal(meta.query_index, q_idx)
    assert meta.token_index.tolist() == list(range(20)) + [20] + list(range(40, 45))
    assert meta.attn_mask.shape == (3, 1, 20, 36)
    assert torch.equal(meta.attn_mask, expected_mask([20, 1, 5], [36, 21, 5]))
    # spot values: A's first query (position 16) sees keys 0..16; B's only query sees 0..20
    assert meta.attn_mask[0, 0, 0].nonzero().flatten().tolist() == list(range(17))
    assert meta.attn_mask[1, 0, 0].nonzero().flatten().tolist() == list(range(21))
    assert meta.attn_mask[1, 0, 1].nonzero().flatten().tolist() == [0]  # padded row
    assert meta.max_context_len == 36


def test_token_index_inverts_query_index():
    meta = build_attention_metadata([3, 1, 4], [3, 9, 6], list(range(8)), [[0], [1], [2]])
    flat = torch.arange(8)
    padded = flat[meta.query_index].flatten()  # [num_seqs * max_q]
    assert torch.equal(padded[meta.token_index], flat)
    assert meta.token_index.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]


def test_build_attention_metadata_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="disagree"):
        build_attention_metadata([2], [2], [0, 1, 2], [[0]])
    with pytest.raises(ValueError, match="disagree"):
        build_attention_metadata([2, 1], [2, 3], [0, 1, 2], [[0]])
    with pytest.raises(ValueError, match="query_len <= context_len"):
        build_attention_metadata([3], [2], [0, 1, 2], [[0]])


def test_prepare_inputs_rejects_out_of_range_chunks():
    req = make_req("r", range(10), [0], computed=8)
    with pytest.raises(ValueError, match="cannot compute tokens 8..10 of 10"):
        prepare_inputs([(req, 3)])
    with pytest.raises(ValueError, match="cannot compute"):
        prepare_inputs([(req, 0)])


def test_slot_outside_reserved_blocks_raises():
    req = make_req("r", range(20), [3], computed=0)  # 20 tokens but one block reserved
    with pytest.raises(IndexError, match="outside the 16 slots"):
        prepare_inputs([(req, 20)])


def test_mrope_positions_with_rope_delta_past_the_prompt():
    """Prompt tokens take the given [3, P] positions; token i >= P takes i + rope_delta on
    all three axes (here a recompute of prompt plus 3 generated tokens, then a decode)."""
    prompt_pos = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5],
                               [0, 1, 2, 2, 3, 3, 4, 5],
                               [0, 1, 2, 3, 2, 3, 4, 5]])
    delta = -2
    req = make_req("v", range(11), [1], computed=0, num_prompt=8, mrope_positions=prompt_pos, rope_delta=delta)
    inp = prepare_inputs([(req, 11)], mrope=True)
    tail = [8 + delta, 9 + delta, 10 + delta]
    assert inp.positions.tolist() == [row + tail for row in prompt_pos.tolist()]
    # a chunk straddling the prompt end
    req.num_computed_tokens = 6
    assert prepare_inputs([(req, 4)], mrope=True).positions.tolist() == [
        [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]]
    # a decode of token 10 only, batched with a text request (positions broadcast to 3 rows)
    req.num_computed_tokens = 10
    text = make_req("t", range(5), [2], computed=3)
    inp = prepare_inputs([(req, 1), (text, 2)], mrope=True)
    assert inp.positions.tolist() == [[8, 3, 4]] * 3
    assert inp.meta.slot_mapping.tolist() == [26, 35, 36]


def test_text_positions_without_mrope():
    req = make_req("t", range(40), [0, 5, 6], computed=33)
    inp = prepare_inputs([(req, 7)])
    assert inp.positions.tolist() == list(range(33, 40))
    assert inp.meta.slot_mapping.tolist() == list(range(97, 104))  # block 6, offsets 1..7


def test_mm_rows_for_chunk_slices_across_boundaries():
    spans = [PlaceholderRange(3, 10, "img1"), PlaceholderRange(20, 4, "img2", item_index=1)]
    emb1 = torch.arange(10.0)[:, None].expand(10, 2)  # row r holds r
    emb2 = 100 + torch.arange(4.0)[:, None].expand(4, 2)

    def rows(start, end):
        return [(off, r[:, 0].tolist()) for off, r in mm_rows_for_chunk(spans, {"img1": emb1, "img2": emb2}, start, end)]

    assert rows(0, 3) == []
    assert rows(0, 8) == [(3, [0, 1, 2, 3, 4])]
    assert rows(8, 22) == [(0, [5, 6, 7, 8, 9]), (12, [100, 101])]
    assert rows(22, 30) == [(0, [102, 103])]
    assert rows(13, 20) == []
    assert rows(0, 30) == [(3, list(range(10))), (20, [100, 101, 102, 103])]


def test_prepare_inputs_places_image_rows_of_a_split_image():
    """Image 1 (tokens 3..12) split by a chunk boundary at 8; the second chunk is batched after
    another request, so its flat indices are offset by that request's tokens."""
    spans = [PlaceholderRange(3, 10, "img1")]
    emb = torch.arange(10.0)[:, None].expand(10, 4)
    ids = list(range(16))
    first = make_req("v", ids, [2], computed=0, mm_features=media_items(spans))
    inp = prepare_inputs([(first, 8)], encoder_outputs={"img1": emb})
    assert inp.mm_token_index.tolist() == [3, 4, 5, 6, 7]
    assert inp.mm_embeds[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert inp.logits_index.tolist() == [] and inp.sampled == []
    other = make_req("t", range(6), [0], computed=4)
    first.num_computed_tokens = 8
    inp = prepare_inputs([(other, 2), (first, 8)], encoder_outputs={"img1": emb})
    assert inp.mm_token_index.tolist() == [2, 3, 4, 5, 6]  # tokens 8..12 of "v" at flat 2..6
    assert inp.mm_embeds[:, 0].tolist() == [5, 6, 7, 8, 9]
    assert inp.logits_index.tolist() == [1, 9]
    assert inp.sampled == [0, 1]


def test_mm_rows_of_a_many_run_item_take_their_own_rows():
    """A video in two runs (a Qwen3-VL video: one run per temporal group, timestamp text
    between): run 2 takes rows 4..7 of the item's rows, wherever a chunk cuts."""
    ranges = [PlaceholderRange(2, 4, "vid", "video", 0, 0), PlaceholderRange(9, 4, "vid", "video", 0, 4)]
    emb = torch.arange(8.0)[:, None].expand(8, 3)

    def rows(start, end):
        return [(off, r[:, 0].tolist()) for off, r in mm_rows_for_chunk(ranges, {"vid": emb}, start, end)]

    assert rows(0, 16) == [(2, [0, 1, 2, 3]), (9, [4, 5, 6, 7])]
    assert rows(4, 11) == [(0, [2, 3]), (5, [4, 5])]
    assert rows(11, 13) == [(0, [6, 7])]
    with pytest.raises(ValueError, match="video item 0 .* has no encoder rows"):
        mm_rows_for_chunk(ranges, {}, 0, 4)
