"""Every sampling value checked where it enters (issue 7, example 3 and the "sampling" kind):
``SamplingParams`` re-validated on assignment, temperatures below vLLM's 1e-5 greedy, limits
named, a request whose sampling fails ends alone with ``finish_reason="error"``; and the
vectorised sampler against the old per-row one."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.sampling_params import MAX_LOGPROBS, SAMPLING_EPS
from atlas_vlm.worker.sampler import sample

pytestmark = pytest.mark.text

PROMPTS = [list(range(100 + 7 * i, 110 + 9 * i)) for i in range(8)]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), max_model_len=256, num_kvcache_blocks=64, dtype="float32")


def assert_all_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


# ---- SamplingParams -----------------------------------------------------------------------
@pytest.mark.parametrize(("name", "value", "cause"), [
    ("temperature", -0.5, "temperature must be >= 0"),
    ("temperature", float("inf"), "temperature"),
    ("top_p", 2.0, r"top_p must be in \(0, 1\]"),
    ("top_k", 1.5, "top_k"),
    ("max_tokens", 0, "max_tokens"),
    ("logprobs", MAX_LOGPROBS + 1, f"MAX_LOGPROBS={MAX_LOGPROBS}"),
    ("stop", [""], "stop strings"),
    ("stop_token_ids", [-3], "stop_token_ids"),
    ("seed", "7", "seed must be an int"),
    ("ignore_eos", "yes", "ignore_eos must be a bool"),
    ("temprature", 0.0, "SamplingParams has no field 'temprature'"),
])
def test_assignment_is_validated_and_leaves_the_value(name, value, cause):
    p = SamplingParams(temperature=0.7, max_tokens=5)
    before = {k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "max_tokens", "logprobs", "stop")}
    with pytest.raises(ValueError, match=cause):
        setattr(p, name, value)
    assert {k: getattr(p, k) for k in before} == before
    assert not hasattr(p, "temprature")


def test_assignment_normalises_like_creation():
    p = SamplingParams()
    p.stop = "x"
    p.temperature = 0
    assert p.stop == ["x"] and p.greedy
    p.stop = None  # vLLM: None means no stop strings
    assert p.stop == [] and SamplingParams(stop_token_ids=None).stop_token_ids == []
    with pytest.raises(ValueError, match=f"logprobs must be at most MAX_LOGPROBS={MAX_LOGPROBS}"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)


def test_greedy_floor_is_vllms_eps():
    assert SAMPLING_EPS == 1e-5
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_tiny_temperature_next_to_a_greedy_request(llm):
    """Issue example 3: both requests finish; the tiny temperature is greedy."""
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                      SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True)],
                        use_tqdm=False)
    alone = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[1].token_ids == alone[0].token_ids
    assert_all_free(llm)


def test_model_limits_checked_at_entry(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids \\[{vocab}\\] are not tokens of this model"):
        llm.generate(PROMPTS[0], SamplingParams(stop_token_ids=[vocab]), use_tqdm=False)
    assert_all_free(llm)
    # a top_k above the vocabulary keeps all of it: same draws as top_k off
    big = SamplingParams(temperature=1.0, top_k=10 * vocab, seed=3, max_tokens=6, ignore_eos=True)
    off = SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=6, ignore_eos=True)
    a, b = (llm.generate(PROMPTS[0], p, use_tqdm=False)[0].token_ids for p in (big, off))
    assert a == b


# ---- a request that fails alone ------------------------------------------------------------
def test_fault_in_one_request_of_eight(llm):
    """NaN logits for one request (injected through the runner's observer hook at its third
    sampled step): it ends with "error", the seven others equal the same batch without a fault."""
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(8)]
    clean = llm.generate(PROMPTS, params, use_tqdm=False)
    target = {"rid": None, "seen": 0}

    def inject(chunks, inp, logits, sampled):
        for row, i in enumerate(sampled):
            req = chunks[i][0]
            if req.prompt is None and req.token_ids[:req.num_prompt_tokens] == PROMPTS[5]:
                target["seen"] += 1
                if target["seen"] == 3:
                    logits[row] = float("nan")
                    target["rid"] = req.request_id

    llm.engine.runner.observers.append(inject)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.runner.observers.remove(inject)
    bad = outs[5]
    assert bad.request_id == target["rid"]
    assert bad.finish_reason == "error" and "not finite" in bad.error
    assert bad.token_ids == clean[5].token_ids[:2]
    for i in range(8):
        if i != 5:
            assert outs[i].token_ids == clean[i].token_ids and outs[i].finish_reason == "length"
            assert outs[i].error is None
    assert_all_free(llm)


# ---- the vectorised sampler against the old per-row one -----------------------------------
def _old_filter(logits, top_k, top_p):
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cut = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(cut).scatter(0, order, cut), float("-inf"))
    return logits


def _old_sample(logits, requests):
    """The per-row sampler this project had before vectorising (kept as the reference)."""
    tokens = []
    for row, req in enumerate(requests):
        p = req.sampling_params
        if p.greedy:
            tokens.append(int(logits[row].argmax()))
        else:
            probs = _old_filter(logits[row] / p.temperature, p.top_k, p.top_p).softmax(-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=req.generator).item()))
    return tokens


class _Req:
    def __init__(self, i, params):
        self.request_id, self.sampling_params = str(i), params
        self.generator = torch.Generator().manual_seed(1000 + i)


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_sampler_equals_the_old_one(seed):
    torch.manual_seed(seed)
    rows, vocab = 12, 500
    logits = torch.randn(rows, vocab) * 3
    g = torch.Generator().manual_seed(seed)
    params = []
    for i in range(rows):
        r = torch.rand(4, generator=g).tolist()
        params.append(SamplingParams(
            temperature=0.0 if r[0] < 0.25 else 0.3 + 2 * r[1],
            top_k=[0, -1, 1, 5, 50, vocab + 10][int(r[2] * 6)],
            top_p=[1.0, 0.9, 0.5, 1e-6][int(r[3] * 4)],
            logprobs=[None, 0, 3][i % 3],
        ))
    for _ in range(3):  # three steps: the generators move on identically
        new, old = [_Req(i, p) for i, p in enumerate(params)], [_Req(i, p) for i, p in enumerate(params)]
        out = sample(logits, new)
        assert out.token_ids == _old_sample(logits, old)
        assert out.errors == [None] * rows
        logp = logits.log_softmax(-1)
        for i, p in enumerate(params):
            if p.logprobs is None:
                assert out.logprobs[i] is None and out.top_logprobs[i] is None
                continue
            assert out.logprobs[i] == pytest.approx(float(logp[i, out.token_ids[i]]), abs=1e-6)
            values, ids = logp[i].topk(p.logprobs)
            assert list(out.top_logprobs[i]) == ids.tolist()
        logits = logits.roll(7, dims=1)


def test_bad_rows_fail_alone():
    logits = torch.randn(6, 50)
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[4, 7] = float("inf")
    logits[5, :40] = float("-inf")  # masked entries but finite ones left: a valid row
    reqs = [_Req(i, SamplingParams(temperature=0.0 if i % 2 else 1.0, logprobs=1)) for i in range(6)]
    out = sample(logits, reqs)
    assert [i for i, t in enumerate(out.token_ids) if t is None] == [1, 2, 4]
    assert [i for i, e in enumerate(out.errors) if e] == [1, 2, 4]
    assert "'1'" in out.errors[1] and "'2'" in out.errors[2] and "'4'" in out.errors[4]
    assert out.token_ids[3] == int(logits[3].argmax())
    assert out.token_ids[5] == int(logits[5].argmax()) >= 40
    ref = _old_sample(logits[[0]], [_Req(0, reqs[0].sampling_params)])
    assert out.token_ids[0] == ref[0]
