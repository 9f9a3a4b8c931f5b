"""Two models alternating under 16 concurrent clients (issue 36, "Must show"): ``alpha``
(tiny Qwen2) and ``beta`` (tiny Llama) behind one server; every answer is a 200 from the
model the request named, its greedy text equal to that model's alone (an in-process ``LLM``
per model). CI runs a bounded 64 requests; ``ATLAS_VLM_ROUTER_SOAK_S=60`` runs the issue's
60 s soak instead (each client keeps alternating until the time is up; docs/server.md).

``ATLAS_VLM_ROUTER_SOAK_MAX_LOADED=1`` makes the models evict each other on every switch
(both still answer; slower: each switch is an unload and a load)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from server_process import TEXT_ARGS, TEXT_LLM_KWARGS, ServerProcess

pytestmark = [pytest.mark.text, pytest.mark.server]
CLIENTS, REQUESTS = 16, 64  # CI: 64 requests in all, 4 per client
SOAK_S = float(os.environ.get("ATLAS_VLM_ROUTER_SOAK_S", "0"))  # > 0: run this long instead
MAX_LOADED = os.environ.get("ATLAS_VLM_ROUTER_SOAK_MAX_LOADED", "2")
PROMPTS = ["Hello there", "Count to three", "Name a colour", "Say something short"]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def models(tiny_models) -> dict[str, str]:
    return {"alpha": str(tiny_models["qwen2"][0]), "beta": str(tiny_models["llama"][0])}


@pytest.fixture(scope="module")
def references(models) -> dict[str, dict[str, str]]:
    """{model: {prompt: greedy text}}, each model alone in process."""
    from atlas_vlm import LLM, SamplingParams

    refs = {}
    for name, path in models.items():
        llm = LLM(path, **TEXT_LLM_KWARGS)
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        refs[name] = {p: o.text for p, o in zip(PROMPTS, outs)}
        del llm
    assert refs["alpha"] != refs["beta"]  # the models can be told apart by what they answer
    return refs


def test_16_clients_alternating_two_models(models, references):
    server = ServerProcess(None, *(a for n, p in models.items() for a in ("--model", f"{n}={p}")),
                           "--max-loaded-models", MAX_LOADED, *TEXT_ARGS, name=None)
    answers, errors = [], []
    deadline = time.monotonic() + SOAK_S

    def client(k: int) -> None:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            i = 0
            while (i < REQUESTS // CLIENTS) if SOAK_S <= 0 else (time.monotonic() < deadline):
                model, prompt = ("alpha", "beta")[(k + i) % 2], PROMPTS[(k + i // 2) % len(PROMPTS)]
                r = http.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                    "max_tokens": MAX_TOKENS})
                (answers if r.status_code == 200 else errors).append((model, prompt, r.status_code, r.text))
                i += 1

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=SOAK_S + 600)
        assert not any(t.is_alive() for t in threads)
        assert server.proc.poll() is None
    finally:
        server.stop()
    print(f"{len(answers)} answers, {len(errors)} errors from {CLIENTS} clients")
    assert errors == []
    assert len(answers) >= REQUESTS if SOAK_S > 0 else len(answers) == REQUESTS
    assert {m for m, *_ in answers} == {"alpha", "beta"}
    for model, prompt, _, body in answers:
        body = httpx.Response(200, text=body).json()
        assert body["model"] == model
        assert body["choices"][0]["message"]["content"] == references[model][prompt], (model, prompt)
