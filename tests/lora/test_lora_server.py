"""LoRA through the real server (``atlas-vlm serve --enable-lora --lora-modules NAME=PATH``):
greedy output with ``model=ADAPTER`` identical to ``LLM.generate(lora_request=...)``, adapters
listed in ``/v1/models`` with ``parent`` = the base, ``/v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` (vLLM's shapes), refusals at load that change nothing, and 404s
naming an unknown adapter and listing those that exist."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from atlas_vlm import LLM, LoRARequest
from atlas_vlm.entrypoints.openai.serving_lora import parse_lora_modules
from helpers import greedy
from lora_helpers import make_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from server_process import TEXT_ARGS, TEXT_LLM_KWARGS, ServerProcess  # noqa: E402

pytestmark = [pytest.mark.text, pytest.mark.server]
PROMPT = "The capital of France is"
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    folder, hf = tiny_models["qwen2"]
    root = tmp_path_factory.mktemp("adapters")
    paths = {"ad0": make_adapter(hf, root / "ad0", 20, r=8), "ad1": make_adapter(hf, root / "ad1", 21, r=4),
             "big": make_adapter(hf, root / "big", 22, r=16)}
    server = ServerProcess(str(folder), *TEXT_ARGS, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                           "--lora-modules", f"ad0={paths['ad0']}", name="base")
    try:
        yield server, folder, paths
    finally:
        server.stop()


def _complete(server, model: str):
    return httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                             "temperature": 0}, timeout=120)


def test_greedy_output_through_the_server_equals_llm(served):
    server, folder, paths = served
    llm = LLM(str(folder), **LORA, **TEXT_LLM_KWARGS)
    want = {name: llm.generate(PROMPT, greedy(8), lora_request=LoRARequest(name, i + 1, str(paths[name])),
                               use_tqdm=False)[0].text for i, name in enumerate(("ad0", "ad1"))}
    want["base"] = llm.generate(PROMPT, greedy(8), use_tqdm=False)[0].text
    assert len(set(want.values())) == 3  # each adapter answers differently from the base
    r = _complete(server, "ad0")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want["ad0"] and r.json()["model"] == "ad0"
    assert _complete(server, "base").json()["choices"][0]["text"] == want["base"]
    assert httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": str(paths["ad1"])},
                      timeout=60).status_code == 200
    assert _complete(server, "ad1").json()["choices"][0]["text"] == want["ad1"]
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "ad1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}, timeout=120)
    assert chat.status_code == 200 and chat.json()["model"] == "ad1"
    models = {m["id"]: m for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}
    assert models["ad0"]["parent"] == "base" and models["ad1"]["root"] == str(paths["ad1"]) and "base" in models


def test_refusals_and_404s(served):
    server, _, paths = served
    ids = lambda: [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]  # noqa: E731
    before = ids()
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(paths["big"])},
                   timeout=60)
    assert r.status_code == 400 and "rank r=16 is above max_lora_rank=8" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "ad0", "lora_path": str(paths["ad1"])},
                   timeout=60)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    assert ids() == before  # nothing changed
    r = _complete(server, "nope")
    assert r.status_code == 404 and "`nope`" in r.json()["error"]["message"] and "ad0" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30)
    assert r.status_code == 404 and "`nope`" in r.json()["error"]["message"] and "ad0" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "ad0"}, timeout=30).status_code == 200
    assert _complete(server, "ad0").status_code == 404 and "ad0" not in ids()
    assert _complete(server, "base").status_code == 200


def test_lora_flags_on_serve():
    """``atlas-vlm serve`` takes LoRAConfig's fields as flags (generated) and --lora-modules
    (ServerConfig); the parsed values reach the configs."""
    from atlas_vlm.entrypoints.cli import build_parser
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args, server_config_from_args

    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8",
                                      "--lora-modules", "a=/x", "b=/y"])
    lc = engine_config_from_args(args).lora_config
    assert (lc.enable_lora, lc.max_loras, lc.max_lora_rank) == (True, 3, 8)
    assert server_config_from_args(args).lora_modules == ["a=/x", "b=/y"]
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
