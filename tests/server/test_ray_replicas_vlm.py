"""Two replicas of the tiny random Qwen2.5-VL on a local Ray Serve (``num_cpus=2``): image
chat answers equal the single-engine ``LLM``'s, and with cache-aware routing every repeat
of an image request lands on the replica that holds its blocks (``cached_tokens`` = all of
its full prompt blocks), where least-loaded routing spreads the repeats."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from helpers import IMAGES, REPO
from server_process import VLM_LLM_KWARGS, free_port
from test_server_vlm import data_uri, image_msg, offline

pytestmark = [pytest.mark.server, pytest.mark.vlm, pytest.mark.ray]

PHOTOS = [IMAGES / name for name in ("grace_hopper.jpg", "rocket.jpg", "chelsea.png", "coffee.png")]


@pytest.fixture(scope="module")
def ray_vl_app(tiny_models):
    import ray
    from ray import serve

    from atlas_vlm.entrypoints.ray_serve import build_app

    # address="local": always a new Ray of our own, never one already running on this host
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        folder = str(tiny_models["qwen2_5_vl"][0])
        serve.run(build_app(dict(model=folder, **VLM_LLM_KWARGS), 2, served_model_names=["tiny-vl"],
                            num_cpus_per_replica=1), name="atlas", route_prefix="/")
        yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("ingress", "atlas")
    finally:
        serve.shutdown()
        ray.shutdown()


async def _chat_all(url: str, messages: list[list[dict]], n: int, **extra) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        rs = await asyncio.gather(*(client.post("/v1/chat/completions", json={
            "model": "tiny-vl", "messages": m, "max_tokens": n, "temperature": 0, **extra}) for m in messages))
    assert [r.status_code for r in rs] == [200] * len(rs), [r.text[:200] for r in rs]
    return [r.json() for r in rs]


def test_image_answers_equal_single_engine(ray_vl_app, vlm_llm):
    url, _ = ray_vl_app
    out = asyncio.run(_chat_all(url, [image_msg(data_uri(p)) for p in PHOTOS], 6))
    for r, path in zip(out, PHOTOS):
        ref = offline(vlm_llm, n=6, path=path)
        assert r["choices"][0]["message"]["content"] == ref.text
        assert r["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def _repeats_cached(url: str, photo, text: str) -> tuple[list[int], int]:
    """One request with ``photo``, then 3 identical ones at once: their cached_tokens."""
    first = asyncio.run(_chat_all(url, [image_msg(data_uri(photo), text)], 2))[0]
    full = (first["usage"]["prompt_tokens"] - 1) // 16 * 16
    # 32 tokens each, ignoring EOS: all three are in flight together, so least-loaded spreads them
    again = asyncio.run(_chat_all(url, [image_msg(data_uri(photo), text)] * 3, 32, ignore_eos=True))
    return [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in again], full


def test_cache_aware_sends_image_repeats_to_the_replica_holding_them(ray_vl_app):
    url, ingress = ray_vl_app
    ingress.set_routing.remote("cache_aware").result()
    cached, full = _repeats_cached(url, PHOTOS[0], "What is in this picture?")
    assert cached == [full] * 3 and full > 0
    ingress.set_routing.remote("least_loaded").result()
    cached_ll, full_ll = _repeats_cached(url, PHOTOS[1], "What is in this picture?")
    ingress.set_routing.remote("cache_aware").result()
    assert cached_ll.count(full_ll) < 3  # spread over both replicas: the other one computes it again
