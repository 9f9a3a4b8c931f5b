"""No request can kill the engine (issue 16): values that cannot work refused at validation;
a request whose own sampling or logprobs fail ends alone with ``finish_reason="error"``
naming the parameter; an unexpected step fault in ``AsyncLLM`` fails every request in
flight, resets the engine (every block back) and the next request is answered exactly; three
in a row declare it dead (``on_dead``, ``alive`` false, new requests refused); inputs are
prepared in the input workers, not the engine thread; shutdown ends every stream at once
even while a step runs."""

from __future__ import annotations

import asyncio
import threading
import time

import helpers
import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.engine.async_llm import AsyncLLM
from atlas_vlm.engine.request_stream import EngineDeadError, EngineStepError
from atlas_vlm.worker.sampler import sample

pytestmark = pytest.mark.text

PROMPTS = [list(range(100 + 7 * i, 110 + 9 * i)) for i in range(6)]
LIMIT_S = 120  # a hang, not slowness, fails


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), max_model_len=256, num_kvcache_blocks=64, dtype="float32")


def assert_all_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests and not engine.scheduler.has_unfinished()


def bypass(params: SamplingParams, **values) -> SamplingParams:
    """Set values validation would refuse (a stand-in for a check that is missing)."""
    for k, v in values.items():
        object.__setattr__(params, k, v)
    return params


# ---- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(top_p=1e-300), "round to 0 in float32"),
    (dict(top_p=1e-46), "round to 0 in float32"),
    (dict(temperature=1e39), "finite in float32"),
    (dict(top_k=2**63), "top_k must be"),
    (dict(seed=2**64), "seed must be an int in"),
    (dict(seed=-(2**63) - 1), "seed must be an int in"),
])
def test_values_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_edge_values_that_work_are_kept():
    assert SamplingParams(top_p=1e-44).top_p == 1e-44  # a subnormal fp32: keeps the best token
    assert SamplingParams(temperature=1e38, seed=2**64 - 1, top_k=2**63 - 1).seed == 2**64 - 1


# ---- the sampler: one row's fault stays in its row ----------------------------------------
class _Req:
    def __init__(self, i, params):
        self.request_id, self.sampling_params = str(i), params
        self.generator = torch.Generator().manual_seed(500 + i)


def test_a_row_whose_filters_leave_nothing_fails_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.8, logprobs=2) for _ in range(5)]
    clean = sample(logits, [_Req(i, p) for i, p in enumerate(params)])
    broken = [_Req(i, p) for i, p in enumerate(params)]
    broken[2].sampling_params = bypass(SamplingParams(temperature=0.9, logprobs=2), top_p=1e-300)
    out = sample(logits, broken)
    assert out.token_ids[2] is None and out.logprobs[2] is None
    assert "request '2'" in out.errors[2] and "top_p=1e-300" in out.errors[2]
    for i in (0, 1, 3, 4):
        assert out.token_ids[i] == clean.token_ids[i] and out.errors[i] is None
        assert out.logprobs[i] == clean.logprobs[i]
    # the other rows' generators moved exactly as in the clean batch
    again = sample(logits, [r for i, r in enumerate(broken) if i != 2])
    ref_reqs = [_Req(i, p) for i, p in enumerate(params)]
    sample(logits, ref_reqs)
    ref = sample(logits, [r for i, r in enumerate(ref_reqs) if i != 2])
    assert again.token_ids == ref.token_ids


def test_a_row_whose_logprobs_break_fails_alone():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    reqs = [_Req(i, SamplingParams(temperature=0, logprobs=3)) for i in range(4)]
    reqs[1].sampling_params = bypass(SamplingParams(temperature=0, logprobs=3), logprobs=10**6)  # > vocab: topk raises
    out = sample(logits, reqs)
    assert out.token_ids[1] is None and "logprobs=1000000" in out.errors[1]
    for i in (0, 2, 3):
        assert out.token_ids[i] == int(logits[i].argmax()) and out.errors[i] is None
        assert list(out.top_logprobs[i]) == logits[i].log_softmax(-1).topk(3).indices.tolist()


def test_engine_request_with_a_broken_top_p_ends_alone(llm):
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=6, ignore_eos=True)
              for i in range(len(PROMPTS))]
    clean = llm.generate(PROMPTS, params, use_tqdm=False)
    broken = list(params)
    broken[3] = bypass(SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True), top_p=0.0)
    outs = llm.generate(PROMPTS, broken, use_tqdm=False)
    assert outs[3].finish_reason == "error" and "top_p=0.0" in outs[3].error and outs[3].token_ids == []
    for i in range(len(PROMPTS)):
        if i != 3:
            assert outs[i].token_ids == clean[i].token_ids and outs[i].finish_reason == "length"
    assert_all_free(llm.engine)


# ---- AsyncLLM: step faults, death, input workers, shutdown --------------------------------
def run_async(coro):
    return helpers.run_async(coro, LIMIT_S)


class _StepFault:
    """A runner observer that raises inside the step while armed (``count`` times)."""

    def __init__(self):
        self.count = 0

    def __call__(self, chunks, inp, logits, sampled):
        if self.count > 0:
            self.count -= 1
            raise RuntimeError("injected step fault")


async def _collect(stream):
    outs = []
    try:
        async for out in stream:
            outs.append(out)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return outs, e
    return outs, None


@pytest.fixture()
def front(llm):
    fault = _StepFault()
    llm.engine.runner.observers.append(fault)
    dead = []
    front = AsyncLLM(llm.engine, input_workers=2, on_dead=dead.append)
    front.fault, front.dead_calls = fault, dead
    yield front
    front.shutdown()
    assert front.join(30)
    llm.engine.runner.observers.remove(fault)
    llm.engine.runner.observers.remove(front._observe_forward)


def test_step_fault_fails_in_flight_requests_then_the_engine_serves_on(llm, front):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].token_ids

    async def scenario():
        streams = [await front.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), f"r{i}")
                   for i, p in enumerate(PROMPTS[:3])]
        first = [await anext(aiter(s)) for s in streams]  # all three are running
        front.fault.count = 1
        results = [await _collect(s) for s in streams]
        after = await front.add_request(PROMPTS[0], greedy, "after")
        outs, err = await _collect(after)
        return first, results, outs, err

    first, results, outs, err = run_async(scenario())
    assert all(f.token_ids for f in first)
    for _outs, e in results:
        assert isinstance(e, EngineStepError) and "injected step fault" in str(e)
    assert err is None and outs[-1].token_ids == ref and outs[-1].finish_reason == "length"
    assert front.alive and front.num_step_failures == 1 and not front.dead_calls
    assert_all_free(llm.engine)


def test_three_faults_in_a_row_declare_the_engine_dead(llm, front):
    async def scenario():
        errors = []
        for i in range(3):
            front.fault.count = 1
            s = await front.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4), f"d{i}")
            errors.append((await _collect(s))[1])
            if i < 2:  # between faults nothing succeeds: no step runs without a request
                assert front.alive
        with pytest.raises(EngineDeadError, match="engine failed"):
            await front.add_request(PROMPTS[1], SamplingParams(max_tokens=2), "late")
        return errors

    front.max_consecutive_step_failures = 3
    errors = run_async(scenario())
    assert all(isinstance(e, EngineStepError) for e in errors)
    deadline = time.monotonic() + 30
    while not front.dead_calls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(front.dead_calls) == 1 and not front.alive and front.dead
    llm.engine.reset()  # the module's LLM serves the other tests
    assert_all_free(llm.engine)


def test_inputs_are_prepared_off_the_engine_thread(llm, front):
    seen = []
    original = llm.engine.process_request

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)

    llm.engine.process_request = spy
    try:
        async def scenario():
            s = await front.add_request("Hello there", SamplingParams(temperature=0, max_tokens=2), "x")
            return await _collect(s)

        outs, err = run_async(scenario())
    finally:
        del llm.engine.process_request
    assert err is None and len(outs[-1].token_ids) == 2
    assert seen and all(name.startswith("atlas-input") for name in seen)


def test_shutdown_ends_streams_at_once_during_a_long_step(llm, front):
    started, release = threading.Event(), threading.Event()

    def slow(chunks, inp, logits, sampled):  # one long step (a big prefill), until released
        if any(req.request_id == "slow" for req, _ in chunks) and not release.is_set():
            started.set()
            release.wait(60)

    llm.engine.runner.observers.append(slow)
    try:
        async def scenario():
            a = await front.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                        "a")
            head = await anext(aiter(a))
            b = await front.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=5), "slow")
            while not started.is_set():
                await asyncio.sleep(0.01)
            front.shutdown()  # the step is still running
            outs_a, err_a = await _collect(a)
            outs_b, err_b = await _collect(b)
            release.set()
            return head, outs_a, err_a, outs_b, err_b

        head, outs_a, err_a, outs_b, err_b = run_async(scenario())
    finally:
        release.set()
        llm.engine.runner.observers.remove(slow)
    assert err_a is None and outs_a[-1].finish_reason == "abort"
    assert outs_a[-1].token_ids[:len(head.token_ids)] == head.token_ids
    assert err_b is None and outs_b[-1].finish_reason == "abort"
    assert front.join(30)
    assert_all_free(llm.engine)


def test_a_caller_cancelled_while_its_input_is_prepared_leaves_nothing(llm, front):
    gate = threading.Event()
    original = llm.engine.process_request

    def slow_prepare(*args, **kwargs):
        gate.wait(30)
        return original(*args, **kwargs)

    llm.engine.process_request = slow_prepare
    try:
        async def scenario():
            task = asyncio.ensure_future(front.add_request(PROMPTS[4], SamplingParams(max_tokens=3), "gone"))
            await asyncio.sleep(0.2)
            task.cancel()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.5)
            s = await front.add_request(PROMPTS[4], SamplingParams(temperature=0, max_tokens=3), "next")
            return await _collect(s)

        outs, err = run_async(scenario())
    finally:
        del llm.engine.process_request
    assert err is None and len(outs[-1].token_ids) == 3
    assert "gone" not in llm.engine.requests
    assert_all_free(llm.engine)
