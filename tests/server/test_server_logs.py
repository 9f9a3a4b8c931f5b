"""Logs a person reads (issue 35, item 3) on the embedded random-weight Qwen2.5-VL
(``default_vlm_model``) served at ``--log-level info`` with ``--log-stats-interval 0.5``:
the startup lines name the chat page URL and warn of random weights, a request's access
line carries its status, token counts and id, a 4xx line its error message, and an engine
line appears while busy. Values only: the log is polled (bounded) until the line is there."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.vlm]

NAME = "random-vl"
POLL_S = 60  # at most, waiting for a line to be written (the server writes it after the response)


@pytest.fixture(scope="module")
def log_server():
    from atlas_vlm.default_models import default_vlm_model

    server = ServerProcess(default_vlm_model(), "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                           "--dtype", "float32", "--log-level", "info", "--log-stats-interval", "0.5", name=NAME)
    yield server
    server.stop()


def wait_for(server, pattern: str) -> re.Match:
    deadline = time.monotonic() + POLL_S
    while True:
        m = re.search(pattern, server.output())
        if m or time.monotonic() > deadline:
            assert m, f"no line matching {pattern!r} in:\n{server.output()[-3000:]}"
            return m
        time.sleep(0.2)


def test_startup_names_the_chat_page_and_warns_of_random_weights(log_server):
    out = log_server.output()
    assert f"chat page: http://127.0.0.1:{log_server.port}/" in out
    assert re.search(r"WARNING atlas_vlm\.serve: the model random-vl has RANDOM weights", out)
    card = httpx.get(log_server.url + "/v1/models").json()["data"][0]
    assert card["random_weights"] is True and {"text", "image", "video"} <= set(card["capabilities"])


def test_access_line_has_status_tokens_and_id(log_server):
    r = httpx.post(log_server.url + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    m = wait_for(log_server, rf'"POST /v1/chat/completions" 200 prompt_tokens=(\d+) completion_tokens=(\d+) '
                             rf'ttft=([0-9.]+)s total=([0-9.]+)s request_id={re.escape(body["id"])}')
    assert (int(m[1]), int(m[2])) == (body["usage"]["prompt_tokens"], 3)
    assert float(m[3]) <= float(m[4])
    assert "uvicorn.access" not in log_server.output() and '"POST /v1/chat/completions HTTP/1.1"' not in \
        log_server.output()  # uvicorn's own access log is off: one line per request


def test_4xx_line_has_its_error_message(log_server):
    r = httpx.post(log_server.url + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2})
    assert r.status_code == 400
    wait_for(log_server, r'"POST /v1/chat/completions" 400 prompt_tokens=- completion_tokens=- ttft=- '
                         r'total=[0-9.]+s request_id=- error="top_logprobs needs logprobs=true"')


def test_engine_line_while_busy(log_server):
    httpx.post(log_server.url + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    m = wait_for(log_server, r"INFO atlas_vlm\.stats: Engine: Avg prompt throughput: [0-9.]+ tokens/s, Avg "
                             r"generation throughput: [0-9.]+ tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, "
                             r"KV cache usage: ([0-9.]+)%, Prefix cache hit rate: ([0-9.]+)%")
    assert 0 <= float(m[3]) <= 100 and 0 <= float(m[4]) <= 100
