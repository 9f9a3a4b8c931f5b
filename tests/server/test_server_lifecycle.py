"""Server guards and lifecycle on a tiny random Qwen2 (fast steps): ``--api-key`` (401 on
``/v1/*``, ``/health`` and ``/metrics`` open; ``Bearer`` or Anthropic's ``x-api-key``),
``--max-waiting-requests`` (503 while the queue is full, served again after), and SIGTERM
in the middle of a stream (the stream ends with ``abort``, the process exits 0 and the port
is free)."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from server_process import ServerProcess, port_is_free

pytestmark = [pytest.mark.server, pytest.mark.text]

KEY = "sk-test-123"
GREEDY = {"extra_body": {"temperature": 0}}  # the anthropic SDK has no sampling arguments


@pytest.fixture(scope="module")
def guarded_server(tiny_models):
    server = ServerProcess(str(tiny_models["qwen2"][0]), "--api-key", KEY, "--max-num-seqs", "1",
                           "--max-waiting-requests", "1", "--kv-cache-memory", "16MiB", name="tiny-qwen2")
    yield server
    server.stop()


def long_stream(server, headers=None):
    """An open streaming completion of ~1000 tokens (EOS ignored): it keeps the one running slot."""
    body = {"model": "tiny-qwen2", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    return httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120)


def data_events(lines, n: int) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
            if len(out) == n:
                break
    return out


def test_api_key_guards_v1_only(guarded_server):
    url = guarded_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and "API key" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    r = guarded_server.client(api_key=KEY).completions.create(model="tiny-qwen2", prompt="Hi", max_tokens=3)
    assert len(r.choices[0].text) > 0 and r.usage.completion_tokens == 3



def test_api_key_as_x_api_key_and_anthropic_401(guarded_server):
    import anthropic

    url = guarded_server.url
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    c = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)  # sends x-api-key
    reply = c.messages.create(model="tiny-qwen2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                              **GREEDY)
    assert reply.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="tiny-qwen2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    body = e.value.response.json()
    assert e.value.status_code == 401 and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error" and "x-api-key" in body["error"]["message"]

def test_503_when_the_waiting_queue_is_full(guarded_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    with long_stream(guarded_server, auth) as a:
        a_lines = a.iter_lines()  # keep a reference: a dropped iterator closes the connection (an abort)
        assert data_events(a_lines, 1)  # A holds the only running slot
        with long_stream(guarded_server, auth) as b:  # B is accepted and waits (headers sent after admission)
            assert b.status_code == 200
            m = guarded_server.metrics()
            assert m["atlas:num_requests_running"] == 1
            r = httpx.post(guarded_server.url + "/v1/completions", headers=auth, timeout=60,
                           json={"model": "tiny-qwen2", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert "--max-waiting-requests 1" in err["message"] and err["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"
    # both streams were closed by the client: aborted, every block back, new requests served
    r = guarded_server.client(api_key=KEY).completions.create(model="tiny-qwen2", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2
    m = guarded_server.metrics()
    assert m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]
    assert m['atlas:request_success_total{finished_reason=abort}'] >= 2


def test_sigterm_mid_stream_exits_0_and_frees_the_port(tiny_models):
    server = ServerProcess(str(tiny_models["qwen2"][0]), "--kv-cache-memory", "16MiB", name="tiny-qwen2")
    try:
        with long_stream(server) as resp:
            lines = resp.iter_lines()
            assert len(data_events(lines, 2)) == 2
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]  # the stream ends (it does not hang)
        finals = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest if x.startswith("data: {")]
        assert finals[-1] == "abort" and rest[-1] == "data: [DONE]"
        assert server.proc.wait(timeout=60) == 0
        assert port_is_free(server.port)
    finally:
        server.stop()
