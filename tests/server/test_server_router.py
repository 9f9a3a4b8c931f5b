"""Several models behind one server (issue 36, item 1): ``--model NAME=PATH`` twice and a
broken one, ``--max-loaded-models 1``. Each answer equals its model's in-process greedy
answer under two clients alternating models; ``/v1/models`` statuses follow loads and
unloads; unknown names are a 404 listing the served ones; a broken model fails its request
with the cause while the others serve; the chat page's model picker sends the chosen model
(the RSS an idle unload returns: ``test_server_router_memory.py``).
``--models-dir`` discovery is checked on files alone."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from chat_browser import browser, open_page, send  # noqa: F401 - browser: a module fixture
from server_process import TEXT_ARGS, TEXT_LLM_KWARGS, ServerProcess

pytestmark = [pytest.mark.text, pytest.mark.server]
PROMPTS = ["Hello there", "Count to three"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_models):
    """Folder ``Alpha`` (tiny Qwen2), ``beta`` (tiny Llama) and ``broken`` (unreadable config)."""
    root = tmp_path_factory.mktemp("router_models")
    (root / "Alpha").symlink_to(tiny_models["qwen2"][0], target_is_directory=True)
    (root / "beta").symlink_to(tiny_models["llama"][0], target_is_directory=True)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    return root


@pytest.fixture(scope="module")
def references(model_dirs):
    """{model name: {prompt: greedy text}} from an in-process ``LLM`` per model."""
    from atlas_vlm import LLM, SamplingParams

    refs = {}
    for name, folder in (("alpha", "Alpha"), ("beta", "beta")):
        llm = LLM(str(model_dirs / folder), **TEXT_LLM_KWARGS)
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        refs[name] = {p: o.text for p, o in zip(PROMPTS, outs)}
        del llm
    assert refs["alpha"] != refs["beta"]
    return refs


@pytest.fixture(scope="module")
def server(model_dirs):
    s = ServerProcess(None, "--model", f"alpha={model_dirs / 'Alpha'}", "--model", f"beta={model_dirs / 'beta'}",
                      "--model", f"broken={model_dirs / 'broken'}", "--max-loaded-models", "1",
                      "--model-load-timeout-s", "200", *TEXT_ARGS, name=None)
    yield s
    s.stop()


def _chat(url: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
        "max_tokens": MAX_TOKENS})


def _statuses(url: str) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


def test_models_alternate_and_answer_as_alone(server, references):
    assert _statuses(server.url) == {"alpha": "unloaded", "beta": "unloaded", "broken": "unloaded"}
    answers, errors = [], []

    def client(first: int):
        for i in range(6):
            model, prompt = ("alpha", "beta")[(first + i) % 2], PROMPTS[i % 2]
            r = _chat(server.url, model, prompt)
            (answers if r.status_code == 200 else errors).append((model, prompt, r.status_code, r.text))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == []
    assert len(answers) == 12
    for model, prompt, _, body in answers:
        body = json.loads(body)
        assert body["model"] == model
        assert body["choices"][0]["message"]["content"] == references[model][prompt], (model, prompt)
    statuses = _statuses(server.url)
    assert sorted(statuses.values()) == ["loaded", "unloaded", "unloaded"]  # --max-loaded-models 1
    loaded = next(m for m in httpx.get(server.url + "/v1/models").json()["data"] if m["status"] == "loaded")
    assert loaded["max_model_len"] == 512 and "text" in loaded["capabilities"]


def test_load_unload_routes_and_metrics(server, references):
    r = httpx.post(server.url + "/models/load", json={"model": "beta"}, timeout=300)
    assert r.status_code == 200 and r.json()["status"] == "loaded"
    assert _statuses(server.url)["beta"] == "loaded"
    assert _statuses(server.url)["alpha"] == "unloaded"
    r = httpx.post(server.url + "/models/unload", json={"model": "beta"}, timeout=60)
    assert r.status_code == 200 and r.json()["was_loaded"] is True
    assert _statuses(server.url)["beta"] == "unloaded"
    r = _chat(server.url, "beta", PROMPTS[0])  # reloads it
    assert r.json()["choices"][0]["message"]["content"] == references["beta"][PROMPTS[0]]
    assert _statuses(server.url)["beta"] == "loaded"
    metrics = server.metrics()
    assert metrics['atlas:generation_tokens_total{model_name=beta}'] >= 1
    assert not any("model_name=alpha" in k for k in metrics)  # alpha is not resident


def test_unknown_and_broken_models(server, references):
    r = _chat(server.url, "gamma", "hi")
    assert r.status_code == 404
    msg = r.json()["error"]["message"]
    assert "gamma" in msg and all(n in msg for n in ("alpha", "beta", "broken"))
    assert httpx.post(server.url + "/models/unload", json={"model": "gamma"}).status_code == 404
    for _ in range(2):  # fails with the cause each time (retried on each request)
        r = _chat(server.url, "broken", "hi")
        assert r.status_code == 500
        msg = r.json()["error"]["message"]
        assert "`broken` failed to load" in msg
        assert _statuses(server.url)["broken"] == "unloaded"
    r = _chat(server.url, "alpha", PROMPTS[1])
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == references["alpha"][PROMPTS[1]]


def test_models_dir_discovery(tmp_path):
    from atlas_vlm.entrypoints.openai.model_specs import ModelSpec, model_specs

    (tmp_path / "Qwen-Coder.Q4_K_M.gguf").write_bytes(b"")
    (tmp_path / "mmproj-Qwen-Coder.Q4_K_M.gguf").write_bytes(b"")
    (tmp_path / "Solo.gguf").write_bytes(b"")
    (tmp_path / "HF-Model").mkdir()
    (tmp_path / "HF-Model" / "config.json").write_text("{}")
    (tmp_path / "pair").mkdir()
    (tmp_path / "pair" / "lm.gguf").write_bytes(b"")
    (tmp_path / "pair" / "mmproj-f16.gguf").write_bytes(b"")
    (tmp_path / "notes").mkdir()
    specs = model_specs([f"x={tmp_path / 'Solo.gguf'}"], str(tmp_path))
    assert specs[0] == ModelSpec("x", str(tmp_path / "Solo.gguf"))
    assert {s.name: (s.model, s.mmproj) for s in specs[1:]} == {
        "hf-model": (str(tmp_path / "HF-Model"), None),
        "pair": (str(tmp_path / "pair" / "lm.gguf"), str(tmp_path / "pair" / "mmproj-f16.gguf")),
        "qwen-coder.q4_k_m": (str(tmp_path / "Qwen-Coder.Q4_K_M.gguf"), str(tmp_path / "mmproj-Qwen-Coder.Q4_K_M.gguf")),
        "solo": (str(tmp_path / "Solo.gguf"), None)}
    with pytest.raises(ValueError, match="two models are named 'solo'"):
        model_specs([str(tmp_path / "Solo.gguf")], str(tmp_path))


def test_chat_page_model_picker(server, browser):  # noqa: F811 - chat_browser's module fixture
    page = open_page(browser.new_context(), server)
    picker = page.locator("#model-picker")
    assert picker.is_visible() and not page.locator("#model-name").is_visible()
    assert [o.get_attribute("value") for o in picker.locator("option").all()] == ["alpha", "beta", "broken"]
    sent = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)["model"])
            if r.url.endswith("/v1/chat/completions") else None)
    picker.select_option("beta")
    send(page, "Hello there", 1)
    assert sent == ["beta"]
    assert _statuses(server.url)["beta"] == "loaded"
    assert page.errors == []
