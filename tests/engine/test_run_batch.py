"""``atlas-vlm run-batch IN OUT`` as a user runs it (``cli.main``) on a tiny random Qwen2:
answers equal the same requests run directly (``LLM``, greedy), per-line errors in the error
file (every input line answered exactly once), and a rerun after an interruption continues
without redoing a line."""

from __future__ import annotations

import contextlib
import json

import pytest

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.entrypoints.cli import main
from atlas_vlm.entrypoints.openai.batch.results import ResultFiles

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512"]
CHAT = [{"role": "user", "content": "Name a colour."}]


def line(cid, url, body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def chat_line(cid, text="Name a colour.", n_tokens=6) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": n_tokens, "temperature": 0}
    return line(cid, "/v1/chat/completions", body)


def completion_line(cid, prompt, n_tokens=6) -> str:
    return line(cid, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": n_tokens, "temperature": 0})


def records(path) -> list[dict]:
    return [json.loads(t) for t in path.read_text().splitlines()] if path.exists() else []


def run(tiny_models, tmp_path, lines, *extra, err=True) -> tuple[int, list[dict], list[dict]]:
    src, out, errf = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    src.write_text("".join(t + "\n" for t in lines))
    argv = ["run-batch", str(src), str(out), "--model", str(tiny_models["qwen2"][0]), "--served-model-name", "tiny",
            *ENGINE, *(["--error-file", str(errf)] if err else []), *extra]
    rc = main(argv)
    return rc, records(out), records(errf)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), kv_cache_memory=64 << 20, max_model_len=512, dtype="float32")


@pytest.mark.text
def test_answers_equal_direct_requests(tiny_models, tmp_path, llm):
    lines = [chat_line("chat-1"), chat_line("chat-2", "Count to three.", 9), completion_line("cmpl", "The sky is"),
             line("emb", "/v1/embeddings", {"model": "tiny", "input": ["a cat", "a dog"]})]
    rc, out, err = run(tiny_models, tmp_path, lines, "--max-concurrency", "2")
    assert rc == 0 and err == []
    by_id = {r["custom_id"]: r for r in out}
    assert sorted(by_id) == ["chat-1", "chat-2", "cmpl", "emb"]
    for r in out:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"].startswith("req_")
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n)  # noqa: E731
    for cid, text, n in (("chat-1", "Name a colour.", 6), ("chat-2", "Count to three.", 9)):
        body = by_id[cid]["response"]["body"]
        expected = llm.chat([{"role": "user", "content": text}], greedy(n), use_tqdm=False)[0]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert body["choices"][0]["message"]["content"] == expected.text
        assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    cmpl = by_id["cmpl"]["response"]["body"]
    assert cmpl["choices"][0]["text"] == llm.generate("The sky is", greedy(6), use_tqdm=False)[0].text
    emb = by_id["emb"]["response"]["body"]["data"]
    direct = llm.embed(["a cat", "a dog"], use_tqdm=False)
    for got, want in zip(emb, direct):
        assert got["embedding"] == pytest.approx(want.embedding, abs=1e-5)


@pytest.mark.text
def test_bad_lines_are_per_line_errors(tiny_models, tmp_path):
    lines = [chat_line("ok"), "{not json", json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
             line("url", "/v1/images", {}), chat_line("ok"), completion_line("neg", "x", -1),
             line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
             line("model", "/v1/completions", {"model": "other", "prompt": "x"}), "", json.dumps([1, 2])]
    rc, out, err = run(tiny_models, tmp_path, lines)
    assert rc == 0
    assert [r["custom_id"] for r in out] == ["ok"]
    assert len(out) + len(err) == len([t for t in lines if t])  # every non-blank line answered once
    got = {(r["custom_id"], r.get("line")): (r["response"]["status_code"], r["error"]["code"],
                                             r["response"]["body"]["error"]["param"]) for r in err}
    assert got == {(None, 2): (400, "invalid_json", None), (None, 3): (400, "invalid_value", "custom_id"),
                   ("url", None): (400, "invalid_url", "url"), ("ok", 5): (400, "duplicate_custom_id", "custom_id"),
                   ("neg", None): (400, "invalid_value", "max_tokens"), ("stream", None): (400, "invalid_value", "stream"),
                   ("model", None): (404, "model_not_found", "model"), (None, 10): (400, "invalid_json", None)}
    assert all(r["error"]["message"] == r["response"]["body"]["error"]["message"] for r in err)


@pytest.mark.text
def test_rerun_after_interruption_does_no_line_twice(tiny_models, tmp_path):
    lines = [chat_line(f"c{i}", f"Say {i}.", 4) for i in range(5)] + ["oops"]
    rc, first, _ = run(tiny_models, tmp_path, lines[:2], err=False)  # the run "stopped" after two lines
    assert rc == 0 and len(first) == 2
    out = tmp_path / "out.jsonl"
    with open(out, "a") as f:  # a crash while the third record was being written
        f.write(chat_line("c2")[:30])
    rc, second, _ = run(tiny_models, tmp_path, lines, err=False)
    assert rc == 0
    assert second[:2] == first  # kept as they were: not run again
    assert sorted(r["custom_id"] or "bad" for r in second) == ["bad", "c0", "c1", "c2", "c3", "c4"]
    rc, third, _ = run(tiny_models, tmp_path, lines, err=False)  # all done: nothing more
    assert rc == 0 and third == second


@pytest.mark.text
def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    assert main(["run-batch", str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")]) == 1
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    src.write_text(chat_line("a") + "\n")
    assert main(["run-batch", str(src), str(src)]) == 1
    assert "is the input file" in capsys.readouterr().err
    out = tmp_path / "out.jsonl"
    out.write_text("not a record\n{}\n")  # a bad line that is not the last one: not ours, not truncated
    assert main(["run-batch", str(src), str(out)]) == 1
    assert "line 1 is not a batch result record" in capsys.readouterr().err
    assert out.read_text() == "not a record\n{}\n"


@pytest.mark.text
def test_result_files_keep_counts_and_cut_only_a_partial_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    ok = {"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    bad = {"id": "batch_req_2", "custom_id": None, "line": 4, "response": {"status_code": 400, "body": {}},
           "error": {"code": "invalid_json", "message": "m"}}
    out.write_text(json.dumps(ok) + "\n" + json.dumps(bad) + "\n" + '{"id": "batch_req_3", "cus')
    with ResultFiles(out) as files:
        assert (files.done_ids, files.done_lines, files.completed, files.failed) == ({"a"}, {4}, 1, 1)
    assert out.read_text() == json.dumps(ok) + "\n" + json.dumps(bad) + "\n"


@pytest.mark.text
def test_ctrl_c_then_rerun_continues(tiny_models, tmp_path):
    """A real interruption: SIGINT to ``atlas-vlm run-batch`` once its first record is out
    (exit 130, the records written stay), then the same command finishes the rest."""
    import signal
    import subprocess
    import sys
    import time

    lines = [line(f"l{i}", "/v1/completions", {"model": "tiny", "prompt": f"Count {i}", "max_tokens": 60,
                                               "temperature": 0, "ignore_eos": True}) for i in range(16)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(t + "\n" for t in lines))
    cmd = [sys.executable, "-m", "atlas_vlm.entrypoints.cli", "run-batch", str(src), str(out), "--model",
           str(tiny_models["qwen2"][0]), "--served-model-name", "tiny", "--max-concurrency", "1", *ENGINE]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # bounded: at most ~4 minutes for the engine to load and answer a line
            if out.exists() and out.read_text().count("\n") >= 1 or proc.poll() is not None:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "rerun the same command to continue" in err
    before = records(out)
    assert 1 <= len(before) < len(lines)
    rc = main(["run-batch", str(src), str(out), "--model", str(tiny_models["qwen2"][0]), "--served-model-name",
               "tiny", *ENGINE])
    after = records(out)
    assert rc == 0 and after[:len(before)] == before
    assert sorted(r["custom_id"] for r in after) == sorted(f"l{i}" for i in range(16))
    assert all(r["response"]["status_code"] == 200 for r in after)


class _OneModel:
    """A server context for a faked endpoint: ``lease`` holds itself (one model)."""

    @contextlib.asynccontextmanager
    async def lease(self, name):
        yield self


def _fake_endpoint(monkeypatch, answers: list):
    """``/v1/completions`` answered by popping ``answers`` (an exception is raised)."""
    from atlas_vlm.entrypoints.openai.batch import runner
    from atlas_vlm.entrypoints.openai.protocol import CompletionRequest

    calls = []

    async def create(ctx, req):
        calls.append(req.prompt)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(runner, "ENDPOINTS", {"/v1/completions": (CompletionRequest, create)})
    monkeypatch.setattr(runner, "QUEUE_FULL_RETRY_S", 0)
    return calls


@pytest.mark.text
def test_a_full_queue_is_waited_out_and_a_dead_engine_stops_the_run(monkeypatch, tmp_path):
    import asyncio

    from atlas_vlm.engine.request_stream import EngineDeadError
    from atlas_vlm.entrypoints.openai.batch.runner import run_lines
    from atlas_vlm.entrypoints.openai.protocol import APIError

    full = APIError(503, "3 requests are waiting", None, "queue_full")
    ok = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
    calls = _fake_endpoint(monkeypatch, [full, full, ok, APIError(503, "dead", None, "engine_unavailable")])
    src = [(1, completion_line("a", "p1").encode()), (2, completion_line("b", "p2").encode()),
           (3, completion_line("c", "p3").encode())]
    with ResultFiles(tmp_path / "out.jsonl") as files:
        with pytest.raises(EngineDeadError):
            asyncio.run(run_lines(_OneModel(), iter(src), files, max_in_flight=1))
    assert calls == ["p1", "p1", "p1", "p2"]  # p1 retried until admitted; p3 never started
    assert [(r["custom_id"], r["response"]["body"]) for r in records(tmp_path / "out.jsonl")] == [("a", ok)]
    aborted = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
    _fake_endpoint(monkeypatch, [aborted])
    with ResultFiles(tmp_path / "out.jsonl") as files:
        with pytest.raises(EngineDeadError, match="shutting down"):
            asyncio.run(run_lines(_OneModel(), iter(src), files, max_in_flight=1))
    assert len(records(tmp_path / "out.jsonl")) == 1  # an aborted answer is not recorded: a rerun does it


@pytest.mark.vlm
def test_image_lines_equal_direct_chat(tiny_models, tmp_path):
    """An ``image_url`` line (a local file under ``--allowed-local-media-path``) answers as
    ``LLM.chat`` on the same image; a file outside that folder is that line's 400."""
    from helpers import IMAGES

    folder = str(tiny_models["qwen2_5_vl"][0])
    photo = IMAGES / "chelsea.png"

    def image_line(cid, url):
        return line(cid, "/v1/chat/completions", {"max_tokens": 6, "temperature": 0, "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "What is it?"}]}]})

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    outside = tmp_path / "copy.png"  # a real image, but not under the allowed folder
    outside.write_bytes(photo.read_bytes())
    src.write_text(image_line("img", f"file://{photo}") + "\n" + image_line("outside", f"file://{outside}") + "\n")
    rc = main(["run-batch", str(src), str(out), "--model", folder, "--dtype", "float32", "--kv-cache-memory", "32MiB",
               "--max-model-len", "1024", "--max-pixels", str(64 * 28 * 28), "--allowed-local-media-path", str(IMAGES)])
    assert rc == 0
    by_id = {r["custom_id"]: r for r in records(out)}
    llm = LLM(folder, kv_cache_memory=32 << 20, max_model_len=1024, max_pixels=64 * 28 * 28, dtype="float32")
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(photo)}, {"type": "text", "text": "What is it?"}]}]
    expected = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    body = by_id["img"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    bad = by_id["outside"]
    assert bad["response"]["status_code"] == 400 and bad["error"]["code"] == "invalid_image"
