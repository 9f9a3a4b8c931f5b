"""Stage 4 with the engine's caches doing work, for every M-RoPE VLM family (the ``vl``
fixture: Qwen2.5-VL and Qwen2-VL): a chunked prefill that splits an image, a prefix-cache
hit on a repeated image prompt, and an encoder-cache hit, each still equal to HF
(greedy tokens, first-step and per-step logits within 1e-4, positions)."""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, CPU_FP32, IMAGES, MAX_MODEL_LEN, SMALL, assert_matches_hf, chat, conv
from atlas_vlm import LLM

pytestmark = pytest.mark.vlm


@pytest.fixture(scope="module")
def llm_chunked(vl):
    """Prefix caching on; at most 32 tokens per step, so a 64-token image spans chunks."""
    return LLM(str(vl[0]), max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=256, kvcache_block_size=BLOCK_SIZE,
               enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=True, **CPU_FP32)


def test_chunked_prefill_splitting_an_image_matches_hf(llm_chunked, vl):
    c = conv(IMAGES / "chelsea.png", text="What animal is this?")
    (out,), rec = chat(llm_chunked, [c], 12, SMALL)
    p = assert_matches_hf(llm_chunked, vl[1], c, out, rec, 12, SMALL)
    (span,) = p.image_spans
    starts = [r["start"] for r in rec.by_request[out.request_id]]
    assert any(span.offset < s < span.offset + span.length for s in starts), (span, starts)


def test_prefix_and_encoder_cache_hits_match_hf(llm_chunked, vl):
    """The same image prompt twice: the second run reuses the first one's KV blocks (prefix
    cache) and its image embeddings (encoder cache: the tower does not run again), and
    still equals HF; a different question about the same image shares the blocks up to
    where the text differs and also equals HF."""
    runner = llm_chunked.engine.runner
    c = conv(IMAGES / "coffee.png", text="What is in the cup?")
    (first,), rec1 = chat(llm_chunked, [c], 8, SMALL)
    assert_matches_hf(llm_chunked, vl[1], c, first, rec1, 8, SMALL)
    runs = runner.num_encoder_runs
    (again,), rec2 = chat(llm_chunked, [c], 8, SMALL)
    req = rec2.by_request[again.request_id][0]["req"]
    assert req.num_cached_tokens >= BLOCK_SIZE * ((len(again.prompt_token_ids) - 1) // BLOCK_SIZE)
    assert again.token_ids == first.token_ids
    assert_matches_hf(llm_chunked, vl[1], c, again, rec2, 8, SMALL)
    other = conv(IMAGES / "coffee.png", text="Is it hot? Answer in one word.")
    (third,), rec3 = chat(llm_chunked, [other], 8, SMALL)
    assert_matches_hf(llm_chunked, vl[1], other, third, rec3, 8, SMALL)
    assert runner.num_encoder_runs == runs  # neither repeat ran the vision tower
