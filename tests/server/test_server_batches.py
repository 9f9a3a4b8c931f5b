"""``/v1/files`` and ``/v1/batches`` as a user drives them with the ``openai`` SDK, on a tiny
random Qwen2 server: a batch's answers equal the same requests sent directly (greedy), bad
lines land in the error file (every line answered once), a batch is cancelled while live
requests are served beside it, uploads are checked (purpose, size) and ``--files-dir`` keeps
files across a restart."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.text]

NAME = "tiny-batch"
MAX_FILE_BYTES = 64 * 1024
POLLS, POLL_S = 600, 0.2  # a batch's status is polled at most this many times


def chat_body(text: str, max_tokens: int = 6, **extra) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def jsonl(items) -> bytes:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
                   for cid, url, body in items).encode()


def start(tiny_models, files_dir) -> ServerProcess:
    return ServerProcess(str(tiny_models["qwen2"][0]), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                         "--max-model-len", "512", "--files-dir", str(files_dir), "--max-file-bytes",
                         str(MAX_FILE_BYTES), "--max-batch-concurrency", "2", name=NAME)


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def server(tiny_models, files_dir):
    s = start(tiny_models, files_dir)
    yield s
    s.stop()


def wait_done(client, batch_id: str):
    for _ in range(POLLS):
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(POLL_S)
    raise AssertionError(f"batch {batch_id} not over after {POLLS} polls: {batch.status}")


def records(client, file_id) -> list[dict]:
    return [json.loads(t) for t in client.files.content(file_id).text.splitlines()] if file_id else []


def test_batch_answers_equal_direct_requests_and_bad_lines_are_errors(server):
    client = server.client()
    good = [(f"chat-{i}", "/v1/chat/completions", chat_body(text, n, ignore_eos=True))
            for i, (text, n) in enumerate([("Hello!", 6), ("Name a fruit.", 9), ("1, 2, 3,", 4)])]
    bad = [("neg", "/v1/chat/completions", chat_body("x", -1)),
           ("wrong-url", "/v1/completions", {"model": NAME, "prompt": "x"}),
           ("chat-0", "/v1/chat/completions", chat_body("again"))]
    upload = client.files.create(file=("in.jsonl", jsonl(good + bad)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(good + bad))
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "t1"})
    assert batch.status == "validating" and batch.metadata == {"job": "t1"}
    batch = wait_done(client, batch.id)
    assert batch.status == "completed" and batch.completed_at is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 3, 3)
    out, err = records(client, batch.output_file_id), records(client, batch.error_file_id)
    assert len(out) + len(err) == 6
    for cid, _, body in good:
        (rec,) = [r for r in out if r["custom_id"] == cid]
        direct = client.chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                                extra_body={"ignore_eos": True})
        got = rec["response"]["body"]
        assert rec["response"]["status_code"] == 200 and rec["error"] is None
        assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert got["usage"]["completion_tokens"] == direct.usage.completion_tokens
    bodies = [r["response"]["body"] for r in out]
    assert batch.model == NAME
    assert batch.usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert batch.usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies) == 6 + 9 + 4
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    codes = {(r["custom_id"], r["response"]["status_code"], r["error"]["code"]) for r in err}
    assert codes == {("neg", 400, "invalid_value"), ("wrong-url", 400, "invalid_url"),
                     ("chat-0", 400, "duplicate_custom_id")}
    assert client.batches.retrieve(batch.id).output_file_id == batch.output_file_id
    assert batch.id in [b.id for b in client.batches.list().data]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_cancel_a_running_batch_while_live_requests_are_served(server):
    client = server.client()
    items = [(f"long-{i}", "/v1/completions", {"model": NAME, "prompt": f"Count {i}", "max_tokens": 200,
                                               "temperature": 0, "ignore_eos": True}) for i in range(40)]
    upload = client.files.create(file=("long.jsonl", jsonl(items)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    live = client.chat.completions.create(**chat_body("Hello!"))  # served while the batch runs
    alone = httpx.post(server.url + "/v1/chat/completions", json=chat_body("Hello!"), timeout=60).json()
    assert live.choices[0].message.content == alone["choices"][0]["message"]["content"]
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_done(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.total == 40 and counts.completed + counts.failed < 40
    assert len(records(client, batch.output_file_id)) == counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"
    for _ in range(POLLS):  # the aborted lines free the engine
        m = server.metrics()
        if m["atlas:num_requests_running"] == 0 and m["atlas:num_requests_waiting"] == 0:
            break
        time.sleep(POLL_S)
    assert m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]


def test_file_routes_and_refusals(server):
    client = server.client()
    data = jsonl([("a", "/v1/chat/completions", chat_body("hi"))])
    f = client.files.create(file=("a.jsonl", data), purpose="batch")
    assert client.files.retrieve(f.id).filename == "a.jsonl"
    assert client.files.content(f.id).content == data
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert f.id not in [x.id for x in client.files.list(purpose="batch_output")]
    assert client.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content("../../etc/passwd")
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not supported"):
        client.files.create(file=("a.jsonl", data), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="file is empty"):
        client.files.create(file=("a.jsonl", b""), purpose="batch")
    r = httpx.post(server.url + "/v1/files", files={"file": ("big.jsonl", b"x" * (MAX_FILE_BYTES + 1))},
                   data={"purpose": "batch"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    r = httpx.post(server.url + "/v1/files", files={"file": ("big.jsonl", b"x" * (2 * MAX_FILE_BYTES))},
                   data={"purpose": "batch"}, timeout=60)
    assert r.status_code == 413 and "--max-file-bytes" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/files", data={"purpose": "batch"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/images'"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/images", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_an_input_that_is_not_jsonl_fails_at_validation(server):
    """OpenAI's validation: ``validating`` -> ``failed`` with ``errors.data[{code, line,
    message, param}]`` naming each line that is no request line; no line is run."""
    client = server.client()
    good = jsonl([("a", "/v1/chat/completions", chat_body("hi"))])
    data = good + b"just some text\n\n[1, 2]\n" + b'{"method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    upload = client.files.create(file=("notes.txt", data), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    assert batch.request_counts.total == batch.request_counts.completed == batch.request_counts.failed == 0
    got = [(e.code, e.line, e.param) for e in batch.errors.data]
    assert got == [("invalid_json", 2, None), ("invalid_json", 4, None), ("invalid_value", 5, "custom_id")]
    assert batch.errors.data[0].message.startswith("line 2: not valid JSON")


def test_files_dir_keeps_files_across_a_restart(server, tiny_models, files_dir):
    client = server.client()
    f = client.files.create(file=("keep.jsonl", b'{"x": 1}\n'), purpose="batch")
    batches = client.batches.list().data  # the earlier tests' (completed, cancelled)
    long = [(f"l{i}", "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 200, "ignore_eos": True})
            for i in range(40)]
    running = client.batches.create(input_file_id=client.files.create(file=("l.jsonl", jsonl(long)),
                                                                      purpose="batch").id,
                                    endpoint="/v1/completions", completion_window="24h")
    assert server.stop() == 0  # SIGTERM while a batch runs: it fails, saying why, and the server exits 0
    again = start(tiny_models, files_dir)
    try:
        c2 = again.client()
        kept = c2.files.retrieve(f.id)
        assert (kept.filename, kept.bytes) == ("keep.jsonl", 9)
        assert c2.files.content(f.id).content == b'{"x": 1}\n'
        listed = {b.id: b for b in c2.batches.list().data}
        for b in batches:
            assert listed[b.id].status == b.status and listed[b.id].request_counts == b.request_counts
            assert len(records(c2, b.output_file_id)) == b.request_counts.completed
        stopped = listed[running.id]
        assert stopped.status == "failed" and stopped.errors.data[0].code == "server_stopped"
        assert len(records(c2, stopped.output_file_id)) == stopped.request_counts.completed
    finally:
        again.stop()
