"""Sampling and stopping on a tiny random Qwen2: seeds, top-k / top-p, stop tokens and
strings, length limits, logprobs against the recorded logits, and streaming."""

from __future__ import annotations

from collections import defaultdict

import pytest

from helpers import StepRecorder
from atlas_vlm import LLM, SamplingParams

pytestmark = pytest.mark.text

PROMPTS = [[101, 202, 303, 404, 505], list(range(1000, 1023))]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), max_model_len=256, num_kvcache_blocks=32, dtype="float32")


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def assert_all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """Greedy outputs (20 tokens, EOS ignored) of PROMPTS, for the stop tests."""
    return gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))


# ---- seeds and filters --------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    def sampled(seed, prompts=PROMPTS[:1]):
        return gen(llm, prompts, SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True))

    a, b, c = sampled(7)[0], sampled(7)[0], sampled(8)[0]
    assert len(a.token_ids) == 10
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    # the request's own generator: the same seed gives the same tokens inside a batch
    batched = sampled(7, prompts=[PROMPTS[1], PROMPTS[0]])[1]
    assert batched.token_ids == a.token_ids
    # not greedy: the sample leaves the argmax path somewhere
    greedy = gen(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert a.token_ids != greedy.token_ids
    assert_all_free(llm)


def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    top_k = gen(llm, PROMPTS, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=8, ignore_eos=True))
    top_p = gen(llm, PROMPTS, SamplingParams(temperature=1.5, top_p=1e-6, seed=4, max_tokens=8, ignore_eos=True))
    for g, k, p in zip(greedy, top_k, top_p):
        assert k.token_ids == g.token_ids == p.token_ids


def test_top_k_and_top_p_keep_samples_inside_the_allowed_set(llm):
    temp = 2.0
    with StepRecorder(llm) as rec:
        k_out = gen(llm, PROMPTS, SamplingParams(temperature=temp, top_k=3, seed=5, max_tokens=10, ignore_eos=True))
        p_out = gen(llm, PROMPTS, SamplingParams(temperature=temp, top_p=0.5, seed=6, max_tokens=10, ignore_eos=True))
    outside_greedy = 0
    for out in k_out:
        for logits, tok in zip(rec.logits[out.request_id], out.token_ids, strict=True):
            assert tok in logits.topk(3).indices.tolist()
            outside_greedy += tok != int(logits.argmax())
    for out in p_out:
        for logits, tok in zip(rec.logits[out.request_id], out.token_ids, strict=True):
            probs = (logits / temp).softmax(-1)
            order = probs.argsort(descending=True)
            mass_before = probs[order].cumsum(0) - probs[order]
            nucleus = order[mass_before < 0.5].tolist()  # smallest set reaching 0.5
            assert tok in nucleus
    assert outside_greedy > 0  # the filters still sample, not argmax


# ---- stopping -----------------------------------------------------------------------------
def test_stop_token_ids_stop_and_are_kept(llm, greedy_ref):
    ref = greedy_ref[1].token_ids
    stop_at = 6
    stop_tok = ref[stop_at]
    first = ref.index(stop_tok)  # stops at its first occurrence
    out = gen(llm, PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_tok, 0]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:first + 1]
    assert out.token_ids[-1] == stop_tok
    assert_all_free(llm)


def test_eos_stops_unless_ignored(llm, greedy_ref):
    """Declare the 4th greedy token an EOS of this engine: generation stops there (kept in
    token_ids), and ``ignore_eos`` runs past it."""
    ref = greedy_ref[0].token_ids
    eos = ref[3]
    engine = llm.engine
    saved = set(engine.eos_token_ids)
    engine.eos_token_ids = saved | {eos}
    try:
        out = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))[0]
        ignored = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    finally:
        engine.eos_token_ids = saved
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(eos) + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == ref
    assert 151645 in saved  # the tiny config's eos_token_id


def test_stop_string_cuts_the_text(llm, greedy_ref):
    tok = llm.tokenizer
    ref = greedy_ref[1].token_ids
    full = tok.decode(ref, skip_special_tokens=True)
    # a stop string: two characters starting in the middle of the decoded text
    k = 8
    prefix = tok.decode(ref[:k], skip_special_tokens=True)
    stop = full[len(prefix):len(prefix) + 2]
    assert len(stop) == 2
    # expected: the first step whose decoded text contains the stop string ends the request
    n = next(i for i in range(1, len(ref) + 1) if stop in tok.decode(ref[:i], skip_special_tokens=True))
    text_n = tok.decode(ref[:n], skip_special_tokens=True)
    out = gen(llm, PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:n]
    assert out.text == text_n[:text_n.find(stop)]
    assert stop not in out.text and full.startswith(out.text)
    assert_all_free(llm)


def test_max_tokens_finishes_with_length(llm, greedy_ref):
    outs = gen(llm, PROMPTS, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 9)])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].token_ids == greedy_ref[0].token_ids[:1]
    assert outs[1].token_ids == greedy_ref[1].token_ids[:9]
    assert outs[1].text == llm.tokenizer.decode(outs[1].token_ids, skip_special_tokens=True)
    assert outs[1].prompt_token_ids == PROMPTS[1]


# ---- logprobs -----------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_recorded_logits(llm, temperature):
    k = 5
    params = SamplingParams(temperature=temperature, seed=9, max_tokens=10, ignore_eos=True, logprobs=k)
    with StepRecorder(llm) as rec:
        outs = gen(llm, PROMPTS, params)
    for out in outs:
        steps = rec.logits[out.request_id]
        assert len(out.logprobs) == len(out.top_logprobs) == len(steps) == 10
        for logits, tok, lp, top in zip(steps, out.token_ids, out.logprobs, out.top_logprobs, strict=True):
            ref = logits.log_softmax(-1)  # the raw distribution, before temperature
            assert lp == pytest.approx(float(ref[tok]), abs=1e-6)
            values, ids = ref.topk(k)
            assert len(top) == k
            assert list(top) == ids.tolist()
            assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-6)
            if temperature == 0:
                assert next(iter(top)) == tok and top[tok] == pytest.approx(lp, abs=1e-6)


def test_logprobs_zero_and_none(llm):
    zero, none = gen(llm, PROMPTS[:1] * 2, [SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True),
                                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
    assert len(zero.logprobs) == 4 and all(lp <= 0 for lp in zero.logprobs)
    assert zero.top_logprobs == [{}, {}, {}, {}]
    assert none.logprobs is None and none.top_logprobs is None
    assert zero.token_ids == none.token_ids


# ---- streaming ----------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0, max_tokens=17, ignore_eos=True), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)],
    [SamplingParams(temperature=1.0, seed=21, max_tokens=12, ignore_eos=True, logprobs=2),
     SamplingParams(temperature=1.0, seed=22, max_tokens=15, ignore_eos=True)],
], ids=["greedy", "seeded"])
def test_streaming_concatenates_to_the_full_result(llm, params):
    full = gen(llm, PROMPTS, params)
    chunks = list(llm.generate(PROMPTS, params, stream=True))
    by_id = defaultdict(list)
    for c in chunks:
        by_id[c.request_id].append(c)
    assert len(by_id) == 2
    streamed = sorted(by_id.values(), key=lambda cs: -len(cs))  # PROMPTS[0] asks more tokens in "greedy"
    for out in full:
        parts = next(cs for cs in by_id.values() if len(cs) == len(out.token_ids))
        assert sum((c.new_token_ids for c in parts), []) == out.token_ids
        assert "".join(c.new_text for c in parts) == out.text
        assert [c.finished for c in parts] == [False] * (len(parts) - 1) + [True]
        assert all(len(c.new_token_ids) == 1 for c in parts)  # one token per step
        last = parts[-1]
        assert last.token_ids == out.token_ids and last.text == out.text and last.finish_reason == out.finish_reason
        assert last.logprobs == out.logprobs
    assert len(streamed[0]) == max(p.max_tokens for p in params)
    assert_all_free(llm)


def test_stopping_a_stream_early_frees_everything(llm):
    it = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), stream=True)
    first = [next(it) for _ in range(3)]
    assert all(not c.finished for c in first)
    assert llm.engine.block_manager.num_free_blocks < llm.engine.block_manager.num_blocks
    it.close()
    assert_all_free(llm)
    assert not llm.engine.scheduler.has_unfinished()
