"""Prefix caching of Qwen3.5 as a VLM (state snapshots, docs/kv-cache.md): a system prompt +
image shared by several questions; the next question resumes from a snapshot after the image
(the tower is not run again), alone and in a batch, with the same greedy tokens as cache off
and every sampled step's logits within 1e-5 (fp32, a tiny random Qwen3.5 with the released
tower geometry)."""

from __future__ import annotations

import pytest

from atlas_vlm import LLM
from helpers import CPU_FP32, IMAGES, chat, conv
from qwen3_5_helpers import build_tiny_qwen3_5, tiny_vl_config

pytestmark = pytest.mark.vlm

PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
BOUNDS = {"min_pixels": 16 * PX, "max_pixels": 40 * PX}
N, INTERVAL, LOGIT_ATOL = 6, 32, 1e-5
SYSTEM = ("You are a careful assistant for a museum archive. Every answer cites the catalogue entry, the room "
          "and the shelf, and says when a record is uncertain.")
# shared text after the image, longer than an interval: a snapshot falls between the image and the question
SHARED = ("Follow the archive's conventions described above and keep the answer short, factual and in plain "
          "English, with no lists and no speculation beyond what the picture shows. ")
QUESTIONS = ["Describe this image.", "What colour is the cat?", "Where would this item be shelved?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_vl_prefix")
    build_tiny_qwen3_5(folder, seed=21, config=tiny_vl_config())
    return folder


def make_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), **{**dict(max_model_len=1024, num_kvcache_blocks=256, kvcache_block_size=16,
                                      max_num_seqs=4, hybrid_snapshot_interval=INTERVAL), **CPU_FP32, **kwargs})


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}] + conv(IMAGES / "chelsea.png", text=SHARED + question)


def run(llm, questions):
    """``[(tokens, sampled logits, first request record)]`` of one ``chat`` call."""
    outs, rec = chat(llm, [conversation(q) for q in questions], N, BOUNDS)
    return [(o.token_ids, rec.sampled_logits(o.request_id), rec.by_request[o.request_id][0]) for o in outs]


@pytest.fixture(scope="module")
def reference(folder):
    llm = make_llm(folder, enable_prefix_caching=False)
    return {q: run(llm, [q])[0] for q in QUESTIONS}


def assert_exact(reference, questions, results):
    for q, (tokens, logits, _) in zip(questions, results):
        ref_tokens, ref_logits, _ = reference[q]
        assert tokens == ref_tokens
        assert len(logits) == len(ref_logits) == N
        assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) < LOGIT_ATOL


def assert_hit_after_the_image(first):
    req = first["req"]
    (span,) = req.mm_positions
    assert first["start"] == req.num_cached_tokens  # the first chunk starts at the hit
    assert req.num_cached_tokens % INTERVAL == 0 and span.end <= req.num_cached_tokens < req.num_prompt_tokens


def test_a_new_question_resumes_after_the_image(folder, reference):
    llm = make_llm(folder)
    (first,) = run(llm, QUESTIONS[:1])
    assert first[2]["req"].num_cached_tokens == 0
    runs = llm.engine.runner.num_encoder_runs
    (second,) = run(llm, QUESTIONS[1:2])
    assert_exact(reference, QUESTIONS[:2], [first, second])
    assert_hit_after_the_image(second[2])
    assert llm.engine.runner.num_encoder_runs == runs  # the image's tokens all came from the cache
    assert llm.engine.block_manager.state_snapshots.hits == 1


def test_a_batch_of_questions_after_the_shared_image(folder, reference):
    llm = make_llm(folder)
    run(llm, QUESTIONS[:1])
    results = run(llm, QUESTIONS[1:])
    assert_exact(reference, QUESTIONS[1:], results)
    for _, _, first in results:
        assert_hit_after_the_image(first)
    assert llm.engine.runner.state_cache.num_free_slots == 4


def test_a_hit_that_ends_inside_the_image_prefills_the_rest_of_it(folder):
    """Questions right after the image: the shared blocks end just past the image, the last
    snapshot (one per block here) falls inside its placeholder run, and the resumed prefill
    takes the image's remaining rows (sliced from the tower's output) with the state restored
    there: tokens and logits as cache off."""

    def inside(question):
        return [{"role": "system", "content": SYSTEM}] + conv(IMAGES / "chelsea.png", text=question)

    def go(llm, questions):
        outs, rec = chat(llm, [inside(q) for q in questions], N, BOUNDS)
        return [(o.token_ids, rec.sampled_logits(o.request_id), rec.by_request[o.request_id][0]) for o in outs]

    off = make_llm(folder, enable_prefix_caching=False, hybrid_snapshot_interval=16)
    reference = {q: go(off, [q])[0] for q in QUESTIONS[:2]}
    llm = make_llm(folder, hybrid_snapshot_interval=16)
    first = go(llm, QUESTIONS[:1])
    second = go(llm, QUESTIONS[1:2])
    assert_exact(reference, QUESTIONS[:2], first + second)
    req = second[0][2]["req"]
    (span,) = req.mm_positions
    assert req.num_cached_tokens % 16 == 0 and span.offset < req.num_cached_tokens < span.end
    assert llm.engine.block_manager.state_snapshots.hits == 1
