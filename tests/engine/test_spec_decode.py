"""Exact speculative decoding (n-gram drafts, greedy): every output equals decoding without
drafts token for token and logprob for logprob (fp32), with drafts accepted and rejected,
batches at different lengths, stop strings / stop tokens / max_tokens inside an accepted run,
n > 1, preemption, an abort mid-run (every block back, no rejected token in the prefix
cache) and an image prompt (M-RoPE positions of drafted rows)."""

from __future__ import annotations

import pytest

from helpers import IMAGES, SMALL, conv
from atlas_vlm import LLM, SamplingParams
from mm_kv_cache_management import RequestState

LOGPROB_ATOL = 1e-4
QUANT_LOGPROB_ATOL = 1e-2
BASE = dict(max_model_len=512, kvcache_block_size=4, num_kvcache_blocks=512, device="cpu", dtype="float32")
PROMPTS = [  # repetitive ones (drafts found and often accepted) and plain ones, different lengths
    "a b c d a b c d a b c d a b c",
    "The quick brown fox jumps. The quick brown fox jumps. The quick brown",
    "Hello",
    "one two three four five six seven eight nine ten one two three four five six seven eight nine",
]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3, **kw)


@pytest.fixture(scope="module")
def folder(tiny_models):
    return tiny_models["qwen2"][0]


@pytest.fixture(scope="module")
def plain(folder):
    return LLM(str(folder), **BASE)


def spec_llm(folder, k=3, **kw):
    kw.setdefault("speculative_disable_by_batch_size", None)  # drafts in batches too: the tests batch requests
    return LLM(str(folder), speculative="ngram", num_speculative_tokens=k, **{**BASE, **kw})


def assert_same(ref, out, atol=LOGPROB_ATOL):
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text
    assert (out.finish_reason, out.stop_reason) == (ref.finish_reason, ref.stop_reason)
    assert len(out.logprobs) == len(ref.logprobs)
    for a, b, ta, tb in zip(out.logprobs, ref.logprobs, out.top_logprobs, ref.top_logprobs):
        assert a == pytest.approx(b, abs=atol)
        assert ta.keys() == tb.keys()
        assert all(ta[t] == pytest.approx(tb[t], abs=atol) for t in ta)


def assert_all_blocks_back(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def assert_cache_holds_only_real_tokens(llm, sequences):
    """Every prefix-cache entry hashes a block of some request's real tokens (prompt +
    accepted output): no rejected draft was ever registered."""
    bs = llm.engine.block_manager.block_size
    real = set()
    for ids in sequences:
        real.update(RequestState("x", list(ids)).block_hashes(bs))
    cached = set(llm.engine.block_manager._cached)
    assert cached and cached <= real


pytestmark = pytest.mark.text


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_batch_equals_plain_decode(folder, plain, k):
    lens = [24, 17, 30, 9]
    params = [greedy(n) for n in lens]
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    llm = spec_llm(folder, k)
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    for r, o, n in zip(ref, out, lens):
        assert_same(r, o)
        assert len(o.token_ids) == n and o.finish_reason == "length"
        assert 0 <= o.spec_decode["accepted"] <= o.spec_decode["proposed"] <= k * o.spec_decode["drafts"]
    total = llm.engine.scheduler.spec_decode_stats
    assert total["accepted"] > 0, "no draft was accepted: the test does not cover acceptance"
    assert total["proposed"] > total["accepted"], "no draft was rejected: the test does not cover rejection"
    assert total["accepted"] == sum(o.spec_decode["accepted"] for o in out)
    assert_all_blocks_back(llm)
    assert_cache_holds_only_real_tokens(llm, [o.prompt_token_ids + o.token_ids for o in out])
    # alone, every accepted draft saves one forward: steps = tokens - accepted (prefill included)
    before = sum(llm.engine.runner.executor_steps.values())
    alone = llm.generate(PROMPTS[0], greedy(30), use_tqdm=False)[0]
    steps = sum(llm.engine.runner.executor_steps.values()) - before
    assert alone.spec_decode["accepted"] > 0
    assert steps == len(alone.token_ids) - alone.spec_decode["accepted"]


def test_stop_string_stop_token_and_max_tokens_cut_inside_a_run(folder, plain):
    ref = plain.generate(PROMPTS, greedy(30), use_tqdm=False)
    llm = spec_llm(folder, 5)
    params = []
    for r in ref:  # stops that hit in the middle of the output (maybe inside an accepted run)
        params.append(greedy(30, stop=[r.text[len(r.text) // 2:len(r.text) // 2 + 3]]))
        params.append(greedy(30, stop_token_ids=[r.token_ids[len(r.token_ids) // 2]]))
        params.append(greedy(len(r.token_ids) // 2 + 1))
    prompts = [p for p in PROMPTS for _ in range(3)]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert any(w.stop_reason is not None for w in want)
    for w, g in zip(want, got):
        assert_same(w, g)
    assert llm.engine.scheduler.spec_decode_stats["accepted"] > 0
    assert_all_blocks_back(llm)


def test_stop_completed_by_the_first_token_of_an_accepted_run(folder, plain):
    """A step whose accepted run has several tokens; a stop string (and, separately, a stop
    token) completed by the run's first token: the tokens after it are void."""
    from atlas_vlm import RequestOutputKind

    llm = spec_llm(folder, 5)
    steps = [o.new_token_ids for o in llm.generate(PROMPTS[0], greedy(30, output_kind=RequestOutputKind.DELTA),
                                                   stream=True)]
    j = next(sum(map(len, steps[:i])) for i, ids in enumerate(steps) if len(ids) >= 2)  # run's first token
    ids = sum(steps, [])
    tok = llm.tokenizer
    stop_text = tok.decode(ids[:j + 1], skip_special_tokens=True)
    assert stop_text != tok.decode(ids[:j], skip_special_tokens=True) and "\ufffd" not in stop_text
    params = [greedy(30, stop=[stop_text])]
    if ids[j] not in ids[:j]:
        params.append(greedy(30, stop_token_ids=[ids[j]]))
    want = plain.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    got = llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    for w, g in zip(want, got):
        assert_same(w, g)
        assert w.finish_reason == "stop" and len(g.token_ids) == j + 1
    assert_all_blocks_back(llm)


def test_streamed_deltas_add_up_to_the_plain_output(folder, plain):
    from atlas_vlm import RequestOutputKind

    params = greedy(30, stop=["zzz"], output_kind=RequestOutputKind.DELTA)
    ref = plain.generate(PROMPTS[1], greedy(30, stop=["zzz"]), use_tqdm=False)[0]
    text, ids = "", []
    for out in spec_llm(folder, 4).generate(PROMPTS[1], params, stream=True):
        text, ids = text + out.text, ids + out.token_ids
    assert (text, ids) == (ref.text, ref.token_ids)


def test_drafts_never_starve_the_other_decodes_of_a_tight_budget(folder):
    kw = dict(max_num_batched_tokens=6, max_num_seqs=4)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[0]]
    ref = LLM(str(folder), **{**BASE, **kw}).generate(prompts, greedy(20), use_tqdm=False)
    llm = spec_llm(folder, 4, **kw)
    decode_steps = []

    def observe(chunks, inp, logits, sampled):
        running = llm.engine.scheduler.running
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
            decode_steps.append((len(chunks), len(running)))

    llm.engine.runner.observers.append(observe)
    out = llm.generate(prompts, greedy(20), use_tqdm=False)
    for r, o in zip(ref, out):
        assert_same(r, o)
    assert decode_steps and all(n == running for n, running in decode_steps)
    assert llm.engine.scheduler.spec_decode_stats["accepted"] > 0


def test_n_copies_of_one_prompt_and_preemption(folder, plain):
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[3]] * 2
    ref = plain.generate(prompts, greedy(40), use_tqdm=False)
    llm = spec_llm(folder, 4, num_kvcache_blocks=40, enable_prefix_caching=False)
    out = llm.generate(prompts, greedy(40), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the block budget did not force a preemption"
    for r, o in zip(ref, out):
        assert_same(r, o)
    assert_all_blocks_back(llm)


def test_abort_mid_run_gives_every_block_back(folder, plain):
    llm = spec_llm(folder, 4)
    eng = llm.engine
    ids = [eng.add_request(p, greedy(40)) for p in PROMPTS]
    for _ in range(6):
        eng.step()
    aborted = eng.abort_request(ids[0])
    assert aborted.finish_reason == "abort"
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    ref = plain.generate(PROMPTS[1:], greedy(40), use_tqdm=False)
    for r, rid in zip(ref, ids[1:]):
        assert finals[rid].token_ids == r.token_ids
    assert_all_blocks_back(llm)
    seqs = [o.prompt_token_ids + o.token_ids for o in finals.values() if o.finish_reason == "length"]
    assert_cache_holds_only_real_tokens(llm, seqs + [aborted.prompt_token_ids + aborted.token_ids])


def test_off_by_default_and_config_errors(folder, plain):
    out = plain.generate(PROMPTS[0], greedy(8), use_tqdm=False)[0]
    assert out.spec_decode is None
    from atlas_vlm.config import EngineConfig

    for kw, field in [(dict(speculative="eagle"), "speculative"), (dict(num_speculative_tokens=2), "speculative"),
                      (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
                      (dict(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(model=str(folder), **kw)


def test_grammar_requests_run_without_drafts_beside_drafted_ones(folder, plain):
    llm = spec_llm(folder, 4)
    params = [greedy(16), SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]})]
    outs = llm.generate([PROMPTS[0], PROMPTS[0]], params, use_tqdm=False)
    assert outs[0].spec_decode["proposed"] > 0 and outs[1].spec_decode["proposed"] == 0
    assert outs[1].text in ("yes", "no") and outs[1].finish_reason == "stop"
    assert_same(plain.generate(PROMPTS[0], greedy(16), use_tqdm=False)[0], outs[0])


@pytest.mark.vlm
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_image_prompt_equals_plain_decode(tiny_models, family):
    folder = tiny_models[family][0]
    prompt = {"messages": conv(IMAGES / "chelsea.png", text="cat cat cat cat cat cat"), "mm_options": SMALL}
    params = greedy(30)
    ref = LLM(str(folder), **BASE).generate(prompt, params, use_tqdm=False)[0]
    llm = spec_llm(folder, 4)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert_same(ref, out)
    assert out.spec_decode["accepted"] > 0, "no draft accepted: drafted M-RoPE rows not covered"
    assert_all_blocks_back(llm)


def test_quantized_model_verifies_drafts_in_the_c_decode_step(folder):
    """Steps with and without drafts run through the one-call C decode step (its bits are the
    op-by-op path's: tests/parity/test_decode_step.py); only the prefill runs op by op; the
    tokens are the plain run's, the logprobs within int8 rounding (the int8 kernels of a
    one-row and a many-row input round differently: not fp32-exact)."""
    kw = dict(quantization="int8")
    plain_q = LLM(str(folder), **{**BASE, **kw})
    ref = plain_q.generate(PROMPTS, greedy(24), use_tqdm=False)
    llm = spec_llm(folder, 3, **kw)
    assert llm.engine.runner.decode_step is not None, llm.engine.runner.decode_step_reason
    out = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    for r, o in zip(ref, out):
        assert_same(r, o, atol=QUANT_LOGPROB_ATOL)
    steps = llm.engine.runner.executor_steps
    assert steps["decode_step"] > 0 and steps["eager"] == 1  # the prefill; drafted steps in C too
    assert sum(o.spec_decode["drafts"] for o in out) > 0
    assert plain_q.engine.runner.executor_steps["eager"] == 1  # without speculation: every decode in C


def test_a_step_that_raises_leaves_no_draft_behind(folder, plain):
    llm = spec_llm(folder, 4)
    eng, fault = llm.engine, {"armed": False}

    def observe(chunks, inp, logits, sampled):
        if fault["armed"] and any(req.spec_token_ids for req, _ in chunks):
            fault["armed"] = False
            raise RuntimeError("injected fault")

    eng.runner.observers.append(observe)
    rid = eng.add_request(PROMPTS[0], greedy(30))
    eng.step()
    fault["armed"] = True
    with pytest.raises(RuntimeError, match="injected"):
        while fault["armed"]:
            eng.step()
    req = eng.requests[rid]
    assert not req.spec_token_ids and req.num_tokens == req.num_computed_tokens + 1
    final = None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.finished), final)
    assert_same(plain.generate(PROMPTS[0], greedy(30), use_tqdm=False)[0], final)


def test_non_finite_logits_in_a_drafted_row_fail_that_request_alone(folder, plain):
    llm = spec_llm(folder, 4)
    victim = {}

    def observe(chunks, inp, logits, sampled):
        for row, index in enumerate(sampled):
            req = chunks[index][0]
            if req.spec_token_ids and req.request_id == victim.get("id"):
                logits[row] = float("nan")  # its first verified row (always taken)
                victim["id"] = None
                return

    llm.engine.runner.observers.append(observe)
    ids = [llm.engine.add_request(p, greedy(30)) for p in PROMPTS[:2]]
    victim["id"] = ids[0]
    finals = {}
    while llm.engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert victim["id"] is None, "no drafted step of the victim was seen"
    assert finals[ids[0]].finish_reason == "error" and "not finite" in finals[ids[0]].error
    assert_same(plain.generate(PROMPTS[1], greedy(30), use_tqdm=False)[0], finals[ids[1]])
    assert_all_blocks_back(llm)


def test_contiguous_kv_cache_equals_plain_decode(folder):
    kw = dict(kv_cache="contiguous", max_model_len=256, num_kvcache_blocks=4)
    ref = LLM(str(folder), **{**BASE, **kw}).generate(PROMPTS, greedy(20), use_tqdm=False)
    llm = spec_llm(folder, 3, **kw)
    out = llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    for r, o in zip(ref, out):
        assert_same(r, o)
    assert llm.engine.scheduler.spec_decode_stats["accepted"] > 0
    assert_all_blocks_back(llm)


def test_no_drafts_while_more_requests_than_the_limit_run(folder, plain):
    params = [greedy(n) for n in (24, 17, 30, 9)]
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    same_length = spec_llm(folder, 3, speculative_disable_by_batch_size=3)  # 4 run together to the end
    same_length.engine.reset()  # the rebuilt scheduler keeps the limit
    out = same_length.generate(PROMPTS, [greedy(20)] * 4, use_tqdm=False)
    assert same_length.engine.scheduler.spec_decode_stats["proposed"] == 0
    assert [o.token_ids for o in out] == [o.token_ids for o in plain.generate(PROMPTS, [greedy(20)] * 4,
                                                                                  use_tqdm=False)]
    staggered = spec_llm(folder, 3, speculative_disable_by_batch_size=2)  # drafts once two have finished
    out = staggered.generate(PROMPTS, params, use_tqdm=False)
    for r, o in zip(ref, out):
        assert_same(r, o)
    assert [o.spec_decode["proposed"] > 0 for o in out] == [True, False, True, False]
    assert_all_blocks_back(staggered)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be an int >= 1"):
        spec_llm(folder, 3, speculative_disable_by_batch_size=0)
