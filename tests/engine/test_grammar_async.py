"""A request's grammar compiles off the engine thread (issue 24, vLLM v1's ``WAITING_FOR_FSM``):
while it compiles (made slow here: the backend's compile waits on a ``threading.Event``) the
request waits holding no block and other requests keep generating; once ready it produces
the same tokens as a synchronous compile; abort while waiting frees everything; a compile
error fails that request alone with ``finish_reason="error"`` naming the field."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import jsonschema
import pytest

from atlas_vlm import LLM, SamplingParams
from mm_kv_cache_management import RequestStatus

pytestmark = pytest.mark.text

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
FREE = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
WAIT_S = 120  # a hang, not slowness, fails


def json_params(seed: int = 3) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured_outputs={"json": SCHEMA})


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), dtype="float32", max_model_len=256, num_kvcache_blocks=64)


class SlowCompile:
    """The backend's compile blocked until ``release`` is set; counts the compiles that ran."""

    def __init__(self, backend, fail_on: str | None = None, error: Exception | None = None):
        self.real, self.fail_on, self.error = backend.compile_grammar, fail_on, error
        self.release, self.calls, self.done = threading.Event(), [], threading.Event()

    def __call__(self, params):
        self.calls.append(params)
        if not self.release.wait(WAIT_S):
            raise RuntimeError("test compile was never released")
        try:
            if self.fail_on is not None and params.regex == self.fail_on:
                raise self.error
            return self.real(params)
        finally:
            self.done.set()


@pytest.fixture
def slow(llm, monkeypatch):
    backend = llm.engine.structured_output_manager.backend  # built before patching
    s = SlowCompile(backend)
    monkeypatch.setattr(backend, "compile_grammar", s)
    yield s
    s.release.set()  # never leave the compile thread blocked


class InlineExecutor:
    """Runs the compile at once on the caller's thread: the synchronous compile of before."""

    def submit(self, fn, *args):
        f = Future()
        f.set_result(fn(*args))
        return f


def run_until_done(engine, outs: dict, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        for o in engine.step():
            outs[o.request_id] = o
        if not engine.has_unfinished_requests():
            return
    raise AssertionError("requests did not finish")


def assert_all_free(engine):
    bm, mgr = engine.block_manager, engine.structured_output_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests and not engine.scheduler.has_unfinished()
    assert not mgr.is_compiling_any() and not mgr.has("b")


def test_slow_compile_does_not_stop_others_and_matches_a_sync_compile(llm, slow, monkeypatch):
    eng = llm.engine
    alone = llm.generate(["Free prompt here"], FREE, use_tqdm=False)[0]
    outs: dict = {}
    eng.add_request("Extract:", json_params(), request_id="b")  # first in the queue
    eng.add_request("Free prompt here", FREE, request_id="a")
    for _ in range(50):
        for o in eng.step():
            outs[o.request_id] = o
        if "a" in outs and outs["a"].finished:
            break
    assert not slow.release.is_set()
    assert outs["a"].finish_reason == "length" and outs["a"].token_ids == alone.token_ids
    b = eng.requests["b"]
    assert "b" not in outs and b.status == RequestStatus.WAITING_FOR_FSM
    assert b.num_computed_tokens == 0 and b.block_table is None  # holds no block
    slow.release.set()
    run_until_done(eng, outs)
    assert outs["b"].finish_reason == "stop", (outs["b"].text, outs["b"].error)
    jsonschema.validate(json.loads(outs["b"].text), SCHEMA)
    assert_all_free(eng)
    monkeypatch.setattr(eng.structured_output_manager, "_compile_pool", InlineExecutor())
    sync = llm.generate(["Extract:"], json_params(), use_tqdm=False)[0]
    assert outs["b"].token_ids == sync.token_ids and outs["b"].text == sync.text


def test_generate_waits_for_the_compile_and_gives_the_same_results(llm, slow):
    """LLM.generate (the synchronous caller) with the compile released only once the free
    request has produced 3 tokens: the same outputs as with an undelayed compile."""
    prompts, params = ["Extract:", "Free prompt here"], [json_params(5), FREE]
    slow.release.set()
    expected = llm.generate(prompts, params, use_tqdm=False)
    slow.release.clear()
    seen = []

    def release_after_3(chunks, inp, logits, sampled):
        for req, _ in chunks:
            if req.sampling_params.structured_outputs is None:
                seen.append(req.num_output_tokens)
                if req.num_output_tokens >= 2:  # its 3rd token is sampled in this step
                    slow.release.set()

    eng = llm.engine
    eng.runner.observers.append(release_after_3)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        eng.runner.observers.remove(release_after_3)
    assert seen[:3] == [0, 1, 2] and slow.release.is_set()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [o.text for o in outs] == [o.text for o in expected]
    assert outs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert_all_free(eng)


def test_abort_while_compiling_frees_everything(llm, slow):
    eng = llm.engine
    eng.add_request("Extract:", json_params(), request_id="b")
    eng.add_request("Extract:", json_params(7), request_id="queued")  # behind b on the compile thread
    assert eng.step() == []  # nothing can run
    out_q = eng.abort_request("queued")  # its compile never starts
    out_b = eng.abort_request("b")  # its compile is under way: dropped when it ends
    assert out_b.finish_reason == "abort" and out_b.token_ids == [] and out_q.finish_reason == "abort"
    assert {o.request_id for o in eng.step()} == {"b", "queued"}
    assert_all_free(eng)
    slow.release.set()
    assert slow.done.wait(WAIT_S)
    assert len(slow.calls) == 1  # the queued compile was cancelled
    assert not eng.structured_output_manager.has("b")
    (after,) = llm.generate(["Free prompt here"], FREE, use_tqdm=False)
    assert after.finish_reason == "length" and len(after.token_ids) == 8


@pytest.mark.parametrize("error", [ValueError("structured_outputs.regex cannot be compiled: too large"),
                                   RuntimeError("library failure")])
def test_a_compile_error_fails_only_that_request(llm, slow, error):
    slow.fail_on, slow.error = "bad[0-9]+", error
    slow.release.set()
    eng = llm.engine
    alone = llm.generate(["Free prompt here"], FREE, use_tqdm=False)[0]
    ok = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[a-z]{3}-[0-9]{2}"})
    bad = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "bad[0-9]+"})
    outs = llm.generate(["Free prompt here", "Say:", "Say:"], [FREE, bad, ok], use_tqdm=False)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == [] and outs[1].text == ""
    assert str(error) in outs[1].error and repr(outs[1].request_id) in outs[1].error
    assert outs[0].finish_reason == "length" and outs[0].token_ids == alone.token_ids
    assert outs[2].finish_reason == "stop" and outs[2].error is None
    assert len(outs[2].text) == 6 and outs[2].text[3] == "-"
    assert_all_free(eng)
