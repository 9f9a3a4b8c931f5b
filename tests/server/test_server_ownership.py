"""Every admitted request ends owned (issue 24): a completions request with one bad prompt
among several is refused (400 naming the prompt) before any prompt is admitted; a stream
closed or dropped without ever being read is no longer live and its blocks are freed; and
SIGTERM after such a request, with a stream in flight, exits 0 without a traceback."""

from __future__ import annotations

import asyncio
import gc
import signal

import httpx
import helpers
import pytest

from server_process import ServerProcess

pytestmark = pytest.mark.text

BAD_BODY = {"model": "tiny-qwen2", "prompt": ["hello there", ""], "max_tokens": 4}
LIMIT_S = 120  # a hang, not slowness, fails


def run_async(coro):
    return helpers.run_async(coro, LIMIT_S)


@pytest.fixture(scope="module")
def front(tiny_models):
    from atlas_vlm.config import EngineConfig
    from atlas_vlm.engine import LLMEngine
    from atlas_vlm.engine.async_llm import AsyncLLM

    engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen2"][0]), dtype="float32", max_model_len=256,
                                    num_kvcache_blocks=32))
    front = AsyncLLM(engine)
    yield front
    front.shutdown()
    assert front.join(30)


async def settled(front) -> bool:
    """The engine has no request and every block is free (waits a bounded time for the
    engine thread to run the aborts the caller posted)."""
    engine = front.engine
    for _ in range(500):
        if not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks:
            return True
        await asyncio.sleep(0.01)
    return False


def test_one_bad_prompt_refuses_the_request_and_admits_none(front):
    from prometheus_client import CollectorRegistry

    from atlas_vlm.entrypoints.openai.api_server import create_app
    from atlas_vlm.entrypoints.openai.media import MediaPolicy
    from atlas_vlm.entrypoints.openai.serving_common import ServerContext

    added = []
    original = front.engine.add_request
    front.engine.add_request = lambda req, *a, **k: added.append(req.request_id) or original(req, *a, **k)
    ctx = ServerContext(front, ["tiny-qwen2"], False, MediaPolicy(), front.engine.max_model_len)
    app = create_app(ctx, CollectorRegistry())

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            bad = await client.post("/v1/completions", json=BAD_BODY)
            state = (dict(front._live), list(added), await settled(front))
            good = await client.post("/v1/completions", json={**BAD_BODY, "prompt": ["hello there", "hi"],
                                                                "ignore_eos": True, "temperature": 0})
            return bad, state, good, await settled(front)

    try:
        bad, (live, admitted, free), good, free_after = run_async(scenario())
    finally:
        del front.engine.add_request
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "prompt.1" and err["message"] == "prompt 1: the prompt is empty"
    assert live == {} and admitted == [] and free
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
    assert len(added) == 2 and front._live == {} and free_after


@pytest.mark.parametrize("how", ["aclose", "drop"])
def test_a_stream_never_read_is_released(front, how):
    from atlas_vlm import SamplingParams

    async def scenario():
        stream = await front.add_request("hello there", SamplingParams(max_tokens=200, ignore_eos=True), f"x-{how}")
        live_before = list(front._live)
        if how == "aclose":
            await stream.aclose()
        else:
            del stream
            gc.collect()
        return live_before, dict(front._live), await settled(front)

    live_before, live_after, free = run_async(scenario())
    assert live_before == [f"x-{how}"] and live_after == {} and free


@pytest.mark.server
def test_sigterm_after_a_refused_multi_prompt_request_exits_0(tiny_models):
    server = ServerProcess(str(tiny_models["qwen2"][0]), "--kv-cache-memory", "16MiB", name="tiny-qwen2")
    try:
        r = httpx.post(server.url + "/v1/completions", json=BAD_BODY, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1"
        body = {**BAD_BODY, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # in flight
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert server.proc.wait(timeout=60) == 0
        assert "Traceback" not in server.output()
    finally:
        server.stop()
