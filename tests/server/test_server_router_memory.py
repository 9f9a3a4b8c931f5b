"""The several-model server's memory and faults (issue 36, "Must show"): ``--idle-unload-s``
gives back at least 80% of the RSS a ~160 MB random-weight model took (the process RSS read
from ``/proc``: before its load, loaded, after its idle unload; a tiny model of the same
family loaded and unloaded first, so the code imported on a first load is not counted), and
a model whose load fails mid-way (its weights file cut short) fails every request waiting
for it with that error while the other model keeps answering, the server stays up, and the
next request tries the load again (which succeeds once the file is whole)."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from server_process import TEXT_ARGS, ServerProcess

pytestmark = [pytest.mark.text, pytest.mark.server]


def _big_llama(out_dir, tiny_dir) -> int:
    """A random Llama whose fp32 weights are ~160 MB (a 151936 x 256 tied embedding), with the
    tokenizer of the tiny model in ``tiny_dir``; returns the weights' bytes on disk."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=AutoConfig.from_pretrained(tiny_dir).vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=True,
                         architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out_dir)
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _settled_rss_kib(pid: int) -> int:
    """The RSS once two reads 0.25 s apart differ by under 2 MiB (an unload's status turns
    before its engine thread has ended and ``malloc_trim`` has run); at most ~10 s."""
    last = _rss_kib(pid)
    for _ in range(40):
        time.sleep(0.25)
        now = _rss_kib(pid)
        if abs(now - last) < 2048:
            return now
        last = now
    return last


def _chat(url: str, model: str, timeout: float = 300) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": model, "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 4})


def _status(url: str, model: str) -> str:
    return {m["id"]: m["status"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}[model]


def _wait_unloaded(url: str, model: str) -> None:
    for _ in range(240):  # bounded poll: at most ~60 s
        if _status(url, model) == "unloaded":
            return
        time.sleep(0.25)
    raise AssertionError(f"{model} still {_status(url, model)}")


def test_idle_unload_returns_80_percent_of_the_models_rss(tiny_models, tmp_path):
    weights = _big_llama(tmp_path / "big", tiny_models["llama"][0])
    assert weights > 150e6
    s = ServerProcess(None, "--model", f"warm={tiny_models['llama'][0]}", "--model", f"big={tmp_path / 'big'}",
                      "--idle-unload-s", "1", "--max-loaded-models", "2", *TEXT_ARGS, name=None)
    try:
        assert _chat(s.url, "warm").status_code == 200  # imports and first-load caches, not the model's memory
        _wait_unloaded(s.url, "warm")
        before = _settled_rss_kib(s.proc.pid)
        assert _chat(s.url, "big").status_code == 200
        loaded = _rss_kib(s.proc.pid)
        _wait_unloaded(s.url, "big")
        after = _settled_rss_kib(s.proc.pid)
    finally:
        s.stop()
    took, returned = loaded - before, loaded - after
    print(f"RSS KiB: before {before}, loaded {loaded}, after {after}; returned {returned / took:.0%}")
    assert took * 1024 > 0.8 * weights, (before, loaded, after)  # the weights dominate what the load took
    assert returned >= 0.8 * took, (before, loaded, after)


def test_a_load_failing_midway_fails_its_waiters_and_is_retried(tiny_models, tmp_path):
    good = tiny_models["llama"][0]
    flaky = tmp_path / "flaky"
    shutil.copytree(good, flaky)
    weights = flaky / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # the header reads; the tensors end early: fails mid-load
    s = ServerProcess(None, "--model", f"alpha={tiny_models['qwen2'][0]}", "--model", f"flaky={flaky}",
                      "--max-loaded-models", "2", *TEXT_ARGS, name=None)
    try:
        assert _chat(s.url, "alpha").status_code == 200
        answers: dict[str, list] = {"flaky": [], "alpha": []}

        def ask(model: str) -> None:
            answers[model].append(_chat(s.url, model))

        threads = [threading.Thread(target=ask, args=(m,)) for m in ["flaky"] * 3 + ["alpha"] * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert [r.status_code for r in answers["alpha"]] == [200] * 3
        assert [r.status_code for r in answers["flaky"]] == [500] * 3
        messages = {r.json()["error"]["message"] for r in answers["flaky"]}
        assert len(messages) <= 2  # one failed load answers every waiter (a late one may start a second try)
        assert all(m.startswith("model `flaky` failed to load: ") for m in messages), messages
        assert _status(s.url, "flaky") == "unloaded" and s.proc.poll() is None
        weights.write_bytes(whole)  # repaired: the next request loads it
        r = _chat(s.url, "flaky")
        assert r.status_code == 200 and r.json()["model"] == "flaky"
        assert _status(s.url, "flaky") == "loaded" and _status(s.url, "alpha") == "loaded"
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    finally:
        s.stop()
