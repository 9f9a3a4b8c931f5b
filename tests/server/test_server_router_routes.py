"""Every model-taking route of the several-model server (issue 36, items 1 and 3): one server,
``alpha`` (tiny Qwen2) and ``beta`` (tiny Llama), ``--kv-cache-dir``. Each route answers
with the model its request names: ``/v1/responses`` (stored, continued on the other model,
in the background) and ``/v1/messages`` give the greedy text ``/v1/chat/completions`` gives
for that model; ``/tokenize``, ``/detokenize``, ``count_tokens`` and ``/v1/embeddings`` run
on the named model; a ``/v1/batches`` file mixing both models (and an unknown one) answers
each line with its own model. An unknown model is a 404 naming it and the served models on
every route. The disk KV tier keeps one fingerprinted folder per model, and a model
unloaded and loaded again finds its prompt's blocks there. Streams (chat, messages,
responses) carry the named model's greedy text and hold it only until they end."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from server_process import TEXT_ARGS, ServerProcess

pytestmark = [pytest.mark.text, pytest.mark.server]
MODELS = ("alpha", "beta")
ASK = [{"role": "user", "content": "Hello there"}]
LONG = "The quick brown fox jumps over the lazy dog. " * 6  # > 2 KV blocks of 16 tokens


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("router_kv")


@pytest.fixture(scope="module")
def server(tiny_models, kv_dir):
    s = ServerProcess(None, "--model", f"alpha={tiny_models['qwen2'][0]}", "--model", f"beta={tiny_models['llama'][0]}",
                      "--max-loaded-models", "2", "--kv-cache-dir", str(kv_dir), *TEXT_ARGS, name=None)
    yield s
    s.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300)


@pytest.fixture(scope="module")
def chat_texts(server) -> dict[str, str]:
    """Each model's greedy chat answer to ``ASK`` (6 tokens)."""
    texts = {}
    for m in MODELS:
        r = _post(server, "/v1/chat/completions", {"model": m, "messages": ASK, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == m
        texts[m] = r.json()["choices"][0]["message"]["content"]
    assert texts["alpha"] != texts["beta"]  # the two models can be told apart by their answers
    return texts


def test_responses_messages_and_tokenizer_routes_use_the_named_model(server, chat_texts):
    statuses = {}
    for m in MODELS:
        r = _post(server, "/v1/responses", {"model": m, "input": "Hello there", "max_output_tokens": 6,
                                            "temperature": 0})
        assert r.status_code == 200, r.text
        resp = r.json()
        assert resp["model"] == m and resp["output"][0]["content"][0]["text"] == chat_texts[m]
        statuses[m] = resp["status"]  # "incomplete" when cut by max_output_tokens
        assert httpx.get(server.url + f"/v1/responses/{resp['id']}", timeout=30).json()["model"] == m
        r = _post(server, "/v1/messages", {"model": m, "messages": ASK, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == m and r.json()["content"][0]["text"] == chat_texts[m]
        count = _post(server, "/v1/messages/count_tokens", {"model": m, "messages": ASK}).json()["input_tokens"]
        assert count == r.json()["usage"]["input_tokens"] > 0
        tokens = _post(server, "/tokenize", {"model": m, "prompt": "Hello there"}).json()["tokens"]
        assert _post(server, "/detokenize", {"model": m, "tokens": tokens}).json()["prompt"] == "Hello there"
    # a stored response continued on the other model; a background response held by its model
    first = _post(server, "/v1/responses", {"model": "alpha", "input": "Hello there", "max_output_tokens": 4,
                                            "temperature": 0}).json()
    r = _post(server, "/v1/responses", {"model": "beta", "input": "And again?", "previous_response_id": first["id"],
                                        "max_output_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "beta"
    queued = _post(server, "/v1/responses", {"model": "beta", "input": "Hello there", "max_output_tokens": 6,
                                             "temperature": 0, "background": True}).json()
    for _ in range(600):  # bounded poll
        done = httpx.get(server.url + f"/v1/responses/{queued['id']}", timeout=30).json()
        if done["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert done["status"] == statuses["beta"] and done["output"][0]["content"][0]["text"] == chat_texts["beta"]


def test_embeddings_differ_by_model(server):
    vecs = {m: _post(server, "/v1/embeddings", {"model": m, "input": "Hello there"}).json()["data"][0]["embedding"]
            for m in MODELS}
    assert len(vecs["alpha"]) == len(vecs["beta"]) == 64 and vecs["alpha"] != vecs["beta"]


def test_batch_lines_pick_their_models(server, chat_texts):
    lines = [{"custom_id": f"{m}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": m, "messages": ASK, "max_tokens": 6, "temperature": 0}}
             for i in range(2) for m in (*MODELS, "gamma")]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    up = httpx.post(server.url + "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
                    timeout=60).json()
    batch = _post(server, "/v1/batches", {"input_file_id": up["id"], "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"}).json()
    for _ in range(600):  # bounded poll
        batch = httpx.get(server.url + f"/v1/batches/{batch['id']}", timeout=30).json()
        if batch["status"] in ("completed", "failed", "cancelled"):
            break
        time.sleep(0.2)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 6, "completed": 4, "failed": 2}

    def records(file_id):
        text = httpx.get(server.url + f"/v1/files/{file_id}/content", timeout=30).text
        return {r["custom_id"]: r["response"] for r in map(json.loads, text.splitlines())}

    for cid, resp in records(batch["output_file_id"]).items():
        model = cid.split("-")[0]
        assert resp["body"]["model"] == model and resp["body"]["choices"][0]["message"]["content"] == chat_texts[model]
    errors = records(batch["error_file_id"])
    assert sorted(errors) == ["gamma-0", "gamma-1"]
    assert all(e["status_code"] == 404 and "gamma" in e["body"]["error"]["message"] for e in errors.values())


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "hi"}),
    ("/v1/embeddings", {"input": "hi"}), ("/v1/messages", {"messages": ASK, "max_tokens": 4}),
    ("/v1/messages/count_tokens", {"messages": ASK}), ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1]}), ("/v1/responses", {"input": "hi"}),
    ("/v1/responses", {"input": "hi", "background": True}), ("/models/load", {}), ("/models/unload", {})])
def test_unknown_model_is_404_listing_the_served_ones(server, path, body):
    r = _post(server, path, {"model": "gamma", **body})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["message"] == "The model `gamma` does not exist; this server serves ['alpha', 'beta']"
    if path.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and err["type"] == "not_found_error"  # Anthropic's shape
    else:
        assert err["code"] == "model_not_found"


def test_disk_tier_one_fingerprinted_folder_per_model(server, kv_dir):
    def complete(model: str) -> dict:
        r = _post(server, "/v1/completions", {"model": model, "prompt": LONG, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        return r.json()

    first = {m: complete(m) for m in MODELS}
    folders = {p.name: len(list(p.glob("*.kvb"))) for p in kv_dir.iterdir() if p.is_dir()}
    assert len(folders) == 2 and all(n >= 2 for n in folders.values()), folders
    assert _post(server, "/models/unload", {"model": "alpha"}).json()["was_loaded"] is True
    again = complete("alpha")  # a new engine: its prompt blocks come from alpha's folder
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (first["alpha"]["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0
    assert again["choices"][0]["text"] == first["alpha"]["choices"][0]["text"]
    assert {p.name for p in kv_dir.iterdir() if p.is_dir()} == set(folders)


def _streamed_text(path: str, lines: list[str]) -> str:
    """The text of an SSE stream's ``data:`` lines, as each API carries its deltas."""
    events = [json.loads(line[len("data: "):]) for line in lines if line != "data: [DONE]"]
    if path == "/v1/chat/completions":
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    if path == "/v1/messages":
        return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_streams_hold_their_model_until_they_end(server, chat_texts):
    bodies = {"/v1/chat/completions": {"model": "alpha", "messages": ASK},
              "/v1/messages": {"model": "beta", "messages": ASK},
              "/v1/responses": {"model": "alpha", "input": "Hello there"}}
    for path, body in bodies.items():
        with httpx.stream("POST", server.url + path, timeout=300, json={
                **body, "stream": True, "temperature": 0,
                ("max_output_tokens" if path == "/v1/responses" else "max_tokens"): 6}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200
        assert _streamed_text(path, lines) == chat_texts[body["model"]]  # the named model's greedy text
    for m in MODELS:  # no request left in flight: each unloads at once (a 409 while one were held)
        r = _post(server, "/models/unload", {"model": m})
        assert r.status_code == 200 and r.json()["was_loaded"] is True
