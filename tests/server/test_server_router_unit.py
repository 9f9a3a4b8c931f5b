"""``ModelRouter`` on fake loaders (no engine, no server; issue 36, items 1 and 3): a load that
fails mid-way fails every request waiting for it with that error while another model keeps
serving, and the next request loads again; a load past ``load_timeout_s`` is a 503 with
``Retry-After`` while it goes on, and serves once done. ``--replicas`` with several models
(Ray Serve) is refused with the reason, from the CLI and from a Ray Serve config."""

from __future__ import annotations

import asyncio
import threading

import pytest

from atlas_vlm.entrypoints.openai.model_router import LoadedModel, ModelRouter
from atlas_vlm.entrypoints.openai.model_specs import SEVERAL_MODELS_WITH_REPLICAS, ModelSpec
from atlas_vlm.entrypoints.openai.protocol import APIError
from atlas_vlm.entrypoints.openai.router_routes import RoutedContext

pytestmark = [pytest.mark.text]
SPECS = [ModelSpec("a", "/models/a"), ModelSpec("b", "/models/b")]


class FakeLoader:
    """``build`` for ``ModelRouter``: model ``b`` waits for ``gate`` then raises ``fail`` (if
    set); every other load returns at once. ``calls`` counts loads by name."""

    def __init__(self):
        self.gate = threading.Event()
        self.fail: Exception | None = None
        self.calls: dict[str, int] = {}

    def __call__(self, spec: ModelSpec) -> LoadedModel:
        self.calls[spec.name] = self.calls.get(spec.name, 0) + 1
        if spec.name == "b":
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail is not None:
                raise self.fail
        return LoadedModel(ctx=f"ctx-{spec.name}", close=lambda: None)


async def _held(router: ModelRouter, name: str) -> str:
    async with RoutedContext(router).lease(name) as ctx:
        return ctx


def test_a_failed_load_fails_its_waiters_then_is_retried_while_others_serve():
    async def scenario():
        loader = FakeLoader()
        loader.fail = OSError("weights file ends early")
        router = ModelRouter(SPECS, loader, max_loaded=2, load_timeout_s=60)
        assert await _held(router, "a") == "ctx-a"
        waiters = [asyncio.create_task(_held(router, "b")) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert router.status("b") == "loading"
        assert await _held(router, "a") == "ctx-a"  # served while b loads
        loader.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert loader.calls["b"] == 1  # one load answered all three
        assert all(isinstance(e, APIError) and e.status == 500 for e in results)
        assert {e.message for e in results} == {"model `b` failed to load: OSError: weights file ends early"}
        assert router.status("b") == "unloaded" and router.status("a") == "loaded"
        loader.fail = None
        assert await _held(router, "b") == "ctx-b"  # the next request tries again
        assert loader.calls["b"] == 2 and router.status("b") == "loaded"
        assert {n: s.in_flight for n, s in router.slots.items()} == {"a": 0, "b": 0}

    asyncio.run(scenario())


def test_a_load_past_the_timeout_is_503_then_serves():
    async def scenario():
        loader = FakeLoader()
        router = ModelRouter(SPECS, loader, max_loaded=1, load_timeout_s=0.1)
        with pytest.raises(APIError) as e:
            await router.acquire("b")
        assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
        assert "`b` is still loading after 0.1 s" in e.value.message
        assert router.status("b") == "loading"
        loader.gate.set()
        assert await _held(router, "b") == "ctx-b"
        assert loader.calls["b"] == 1  # the timed-out request did not start a second load
        with pytest.raises(APIError) as e:
            await router.acquire("gamma")
        assert e.value.status == 404 and e.value.message == "The model `gamma` does not exist; this server serves ['a', 'b']"

    asyncio.run(scenario())


def test_replicas_with_several_models_are_refused_with_the_reason(tmp_path, capsys):
    from atlas_vlm.entrypoints.cli import main

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code = main(["serve", "--model", f"a={tmp_path / 'a'}", "--model", f"b={tmp_path / 'b'}", "--replicas", "2"])
    err = capsys.readouterr().err
    assert code == 1 and f"2 models with --replicas 2: {SEVERAL_MODELS_WITH_REPLICAS}" in err
    assert "the ingress picks a replica by prefix cache and load, not by the request's `model`" in err
    from atlas_vlm.entrypoints.ray_serve import app_builder

    with pytest.raises(ValueError, match="`models` in a Ray Serve application: --replicas N serves N copies"):
        app_builder({"models": ["a=/x", "b=/y"], "num_replicas": 2})
