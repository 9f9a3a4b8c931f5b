"""One request never takes the server down (issue 16), on a tiny random Qwen2 served by
``tests/server/fault_server.py`` (``atlas-vlm serve`` with test-only faults keyed on the
prompt): an unexpected step fault ends the stream in flight with an error event and
``[DONE]`` (a ``/v1/responses`` stream: ``error``, then ``response.failed``), answers the
non-streamed ones 500 with OpenAI's JSON, gives every block back, and
the next request is answered exactly; three faults in a row stop the process with exit
code 1 (no zombie answering 503); SIGTERM during a long prefill step ends every stream with
``abort`` and ``[DONE]`` and exits 0; clients that hang up while queued are dropped before
their prefill."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx
import pytest

from helpers import REPO
from server_process import ServerProcess, port_is_free

pytestmark = [pytest.mark.server, pytest.mark.text]

LAUNCHER = [sys.executable, str(REPO / "tests" / "server" / "fault_server.py")]
NAME = "tiny-qwen2"
LIMIT_S = 120


def start(tiny_models, *args, env=None) -> ServerProcess:
    return ServerProcess(str(tiny_models["qwen2"][0]), "--kv-cache-memory", "16MiB", "--dtype", "float32", *args,
                         name=NAME, launcher=LAUNCHER, env=env)


def body(prompt: str, **kw) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}


def wait_for(pred, what: str, limit_s: float = LIMIT_S):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def events(lines) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


@pytest.fixture(scope="module")
def fault_server(tiny_models):
    server = start(tiny_models)
    yield server
    server.stop()


def test_step_fault_fails_in_flight_requests_cleanly_and_the_server_serves_on(fault_server):
    url = fault_server.url + "/v1/completions"
    ref = httpx.post(url, json=body("The reference prompt"), timeout=LIMIT_S).json()["choices"][0]
    plain = {}

    def non_streamed():
        plain["r"] = httpx.post(url, json=body("A long plain request", max_tokens=400, ignore_eos=True),
                                timeout=LIMIT_S)

    with httpx.stream("POST", url, json=body("A long stream", max_tokens=400, ignore_eos=True, stream=True),
                      timeout=LIMIT_S) as resp:
        lines = resp.iter_lines()
        assert json.loads(next(x for x in lines if x.startswith("data: "))[6:])["choices"][0]["text"] is not None
        t = threading.Thread(target=non_streamed)
        t.start()
        wait_for(lambda: fault_server.metrics()["atlas:num_requests_running"] == 2, "two requests running")
        r = httpx.post(url, json=body("FAULT-STEP now"), timeout=LIMIT_S)
        rest = events(lines)
        t.join(LIMIT_S)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "engine_step_failed" and r.json()["error"]["type"] == "server_error"
    assert "injected step fault" in r.json()["error"]["message"]
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == "engine_step_failed" and "injected step fault" in err["message"]
    assert plain["r"].status_code == 500 and plain["r"].json()["error"]["code"] == "engine_step_failed"
    m = fault_server.metrics()
    assert m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]
    assert m["atlas:num_requests_running"] == 0 and m["atlas:num_requests_waiting"] == 0
    assert httpx.get(fault_server.url + "/health").status_code == 200
    after = httpx.post(url, json=body("The reference prompt"), timeout=LIMIT_S).json()["choices"][0]
    assert after["text"] == ref["text"] and after["finish_reason"] == ref["finish_reason"]


def test_step_fault_ends_a_responses_stream_with_error_and_response_failed(fault_server):
    """/v1/responses: the stream in flight gets an ``error`` event (``engine_step_failed``)
    and then ``response.failed``; every block comes back. A ``SLOW-DECODE`` completion in the
    same batch keeps every step slow, so the stream is still running when the fault comes."""
    req = {"model": NAME, "input": "A long stream", "max_output_tokens": 400, "temperature": 0, "stream": True}
    slow = body("SLOW-DECODE Hello", max_tokens=1000, ignore_eos=True, stream=True)
    with httpx.stream("POST", fault_server.url + "/v1/completions", json=slow, timeout=LIMIT_S) as slow_resp, \
            httpx.stream("POST", fault_server.url + "/v1/responses", json=req, timeout=LIMIT_S) as resp:
        slow_lines = slow_resp.iter_lines()
        next(x for x in slow_lines if x.startswith("data: "))
        lines = resp.iter_lines()
        first = [json.loads(next(x for x in lines if x.startswith("data: "))[6:])["type"] for _ in range(5)]
        assert first[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in first
        r = httpx.post(fault_server.url + "/v1/completions", json=body("FAULT-STEP now"), timeout=LIMIT_S)
        rest = [json.loads(x[6:]) for x in events(lines)]
        assert events(slow_lines)[-1] == "data: [DONE]"
    assert r.status_code == 500
    assert [e["type"] for e in rest[-2:]] == ["error", "response.failed"]
    assert rest[-2]["code"] == "engine_step_failed" and "injected step fault" in rest[-2]["message"]
    assert rest[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in rest] == list(range(5, 5 + len(rest)))
    wait_for(lambda: (lambda m: m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"])(
        fault_server.metrics()), "every block free")


def test_queued_clients_that_hang_up_are_dropped_before_prefill(tiny_models):
    server = start(tiny_models, "--max-num-seqs", "1")
    try:
        url = server.url + "/v1/completions"
        n_hello = httpx.post(url, json=body("SLOW-DECODE Hello", max_tokens=1),
                             timeout=LIMIT_S).json()["usage"]["prompt_tokens"]
        before = server.metrics()["atlas:prompt_tokens_total"]
        with httpx.stream("POST", url, json=body("SLOW-DECODE Hello", max_tokens=1000, ignore_eos=True, stream=True),
                          timeout=LIMIT_S) as resp:
            lines = resp.iter_lines()
            first = json.loads(next(x for x in lines if x.startswith("data: "))[6:])
            assert first["choices"][0]["index"] == 0

            def hang_up(prompt):  # waits queued behind the stream, then the client gives up
                try:
                    httpx.post(url, json=body(prompt, max_tokens=4), timeout=httpx.Timeout(LIMIT_S, read=0.5))
                except httpx.ReadTimeout:
                    pass

            threads = [threading.Thread(target=hang_up, args=(p,)) for p in ("one two three four five six",
                                                                              "seven eight nine ten eleven")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(LIMIT_S)
            wait_for(lambda: server.metrics()["atlas:num_requests_waiting"] == 0, "the queued requests dropped")
            m = server.metrics()
            assert m["atlas:num_requests_running"] == 1  # the stream still runs
            assert m['atlas:request_success_total{finished_reason=abort}'] == 2
        wait_for(lambda: server.metrics()["atlas:num_requests_running"] == 0, "the stream aborted")
        m = server.metrics()
        # only the stream's prompt was ever prefilled, never the two that hung up while queued
        assert m["atlas:prompt_tokens_total"] - before == n_hello
        assert m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]
    finally:
        server.stop()


def test_three_faults_in_a_row_exit_non_zero(tiny_models):
    server = start(tiny_models)
    try:
        for i in range(3):
            r = httpx.post(server.url + "/v1/completions", json=body(f"FAULT-STEP {i}"), timeout=LIMIT_S)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_step_failed"
        assert server.proc.wait(timeout=LIMIT_S) == 1
        assert "engine is dead" in server.output()
        assert port_is_free(server.port)
    finally:
        server.stop()


def test_sigterm_during_a_long_prefill_step_aborts_every_stream_and_exits_0(tiny_models, tmp_path):
    marker = tmp_path / "in-step"
    server = start(tiny_models, env={"ATLAS_TEST_SLOW_MARKER": str(marker), "ATLAS_TEST_SLOW_S": "6"})
    try:
        url = server.url + "/v1/completions"
        results = {}

        def stream(key, prompt):
            with httpx.stream("POST", url, json=body(prompt, max_tokens=900, ignore_eos=True, stream=True),
                              timeout=LIMIT_S) as resp:
                results[key] = (resp.status_code, events(resp.iter_lines()))

        # SLOW-DECODE: the first stream is still running when SIGTERM comes, however fast the machine
        a = threading.Thread(target=stream, args=("running", "SLOW-DECODE Hello"))
        a.start()
        wait_for(lambda: server.metrics()["atlas:generation_tokens_total"] > 2, "the first stream decoding")
        b = threading.Thread(target=stream, args=("prefill", "SLOW-STEP a long prompt"))
        b.start()
        wait_for(marker.exists, "the long prefill step")
        server.proc.send_signal(signal.SIGTERM)
        a.join(LIMIT_S)
        b.join(LIMIT_S)
        for key in ("running", "prefill"):
            status, evs = results[key]
            assert status == 200 and evs[-1] == "data: [DONE]", (key, evs[-3:])
            assert json.loads(evs[-2][6:])["choices"][0]["finish_reason"] == "abort", key
        assert server.proc.wait(timeout=LIMIT_S) == 0
        assert "terminate called" not in server.output()
        assert port_is_free(server.port)
    finally:
        server.stop()
