"""A hybrid model (recurrent-state layers beside paged K/V) through the real engine: greedy
tokens and logprobs equal a cache-free recompute of every sequence (tests/hybrid_toy.py) in a
batch, with chunked prefill, under preemption and around an abort; state slots are taken at
admission and all given back; the options a hybrid cannot run with are refused by name."""

from __future__ import annotations

import random

import pytest

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.engine.plan import KVBudgetError
from hybrid_toy import build_tiny_llama, reference_greedy, toy_swapped_in

pytestmark = pytest.mark.text
LOGPROB_ATOL = 1e-4
MAX_SEQS = 4
rng = random.Random(0)
PROMPTS = [[rng.randrange(100, 5000) for _ in range(n)] for n in (3, 17, 9, 30, 1)]
MAX_TOKENS = [8, 5, 10, 6, 7]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("hybrid_toy") / "llama4")


def make_llm(folder, **kwargs):
    base = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=4, max_num_seqs=MAX_SEQS,
                kv_cache_memory=1 << 20)
    with toy_swapped_in() as built:
        llm = LLM(str(folder), **{**base, **kwargs})
    return llm, built[0]


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def assert_equals_reference(model, prompt, out, n):
    tokens, logprobs = reference_greedy(model, prompt, n)
    assert out.token_ids == tokens
    assert out.logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def generate_and_check(llm, model, max_tokens=MAX_TOKENS):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, [params(n) for n in max_tokens], use_tqdm=False)
    for prompt, out, n in zip(PROMPTS, outs, max_tokens):
        assert_equals_reference(model, prompt, out, n)
    assert llm.engine.runner.state_cache.num_free_slots == MAX_SEQS  # every slot back


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=2048), dict(max_num_batched_tokens=8),
                                     dict(kv_cache="contiguous", max_model_len=64)],
                         ids=["whole_prompts", "chunked_prefill", "contiguous_kv"])
def test_batch_equals_reference(folder, options):
    llm, model = make_llm(folder, **options)
    generate_and_check(llm, model)
    assert llm.engine.scheduler.num_preemptions == 0


def test_preemption_recomputes_from_a_fresh_state(folder):
    llm, model = make_llm(folder, num_kvcache_blocks=12, max_num_batched_tokens=16)  # 48 tokens of KV
    generate_and_check(llm, model, [16] * len(PROMPTS))
    assert llm.engine.scheduler.num_preemptions > 0


def test_abort_mid_run_leaves_the_others_exact(folder):
    llm, model = make_llm(folder, max_num_batched_tokens=8)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, params(n)) for p, n in zip(PROMPTS[:3], (12, 12, 12))]
    for _ in range(6):  # the first two mid-decode, the third mid-prefill or decode
        engine.step()
    assert engine.runner.state_cache.num_free_slots == MAX_SEQS - 3
    aborted = engine.abort_request(ids[1])
    assert engine.runner.state_cache.num_free_slots == MAX_SEQS - 2  # the abort gave its slot back
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[ids[1]].finish_reason == "abort"
    tokens, _ = reference_greedy(model, PROMPTS[1], 12)
    assert aborted.token_ids == tokens[:len(aborted.token_ids)]
    for rid in (ids[0], ids[2]):
        prompt = PROMPTS[ids.index(rid)]
        assert_equals_reference(model, prompt, finals[rid], 12)
    assert engine.runner.state_cache.num_free_slots == MAX_SEQS


def test_finish_frees_the_slot_and_admission_needs_one(folder):
    llm, model = make_llm(folder, max_num_seqs=2)
    engine = llm.engine
    assert engine.runner.state_cache.num_slots == 2
    short = engine.add_request({"prompt_token_ids": PROMPTS[0]}, params(2))
    long = engine.add_request({"prompt_token_ids": PROMPTS[1]}, params(6))
    third = engine.add_request({"prompt_token_ids": PROMPTS[2]}, params(3))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == [short, long]  # no slot for the third
    assert {r.state_slot for r in engine.scheduler.running} == {0, 1}
    engine.step()  # the short one finishes with its second token
    assert engine.requests[third].state_slot is None
    assert short not in engine.requests
    engine.step()  # its slot goes to the third
    assert engine.requests[third].state_slot is not None
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert_equals_reference(model, PROMPTS[2], outs[third], 3)
    assert engine.runner.state_cache.num_free_slots == 2


def test_reset_gives_every_slot_back(folder):
    llm, model = make_llm(folder)
    engine = llm.engine
    for p in PROMPTS[:3]:
        engine.add_request({"prompt_token_ids": p}, params(5))
    engine.step()
    assert engine.runner.state_cache.num_free_slots == MAX_SEQS - 3
    assert len(engine.reset()) == 3
    assert engine.runner.state_cache.num_free_slots == MAX_SEQS
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[3]}], params(4), use_tqdm=False)
    assert_equals_reference(model, PROMPTS[3], out, 4)


def test_state_and_kv_share_one_budget(folder, caplog):
    budget = 1 << 20
    with caplog.at_level("INFO", logger="atlas_vlm.engine.engine"):
        llm, _ = make_llm(folder, kv_cache_memory=budget, enable_prefix_caching=True)
    assert [r.message for r in caplog.records if "prefix caching off" in r.message] == [
        "prefix caching off for HybridToyLM: a hybrid model's prefix hit would skip tokens whose recurrent "
        "state is not stored"]
    runner = llm.engine.runner
    state = runner.state_cache
    state_bytes = state.conv.nbytes + state.recurrent.nbytes
    assert state_bytes == MAX_SEQS * state.spec.bytes_per_seq
    kv = runner.kv_cache
    kv_bytes = sum(t.nbytes for t in (kv.k_cache, kv.v_cache))
    assert kv.k_cache.shape[0] == 1  # only the one full-attention layer holds K/V
    assert kv_bytes <= budget - state_bytes < kv_bytes + kv.spec.bytes_per_token * runner.block_size
    assert not llm.engine.block_manager.enable_prefix_caching  # asked for, forced off
    assert "hybrid" in runner.compile_decode_reason and "hybrid" in runner.decode_step_reason


def test_budget_too_small_for_the_state_names_the_numbers(folder):
    with pytest.raises(KVBudgetError, match=r"max_num_seqs=4 x \d+ bytes = \d+ bytes"):
        make_llm(folder, kv_cache_memory=4096)
    llm, _ = make_llm(folder, kv_cache_memory=4096, num_kvcache_blocks=8)  # explicit blocks: no budget shared
    assert llm.engine.runner.num_blocks == 8 and llm.engine.runner.state_cache.num_slots == MAX_SEQS


@pytest.mark.parametrize("option, pattern", [
    (dict(speculative="ngram"), "cannot roll back"),
    (dict(deterministic=True), "deterministic=True does not serve hybrid"),
])
def test_options_a_hybrid_cannot_run_are_refused(folder, option, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_llm(folder, **option)
