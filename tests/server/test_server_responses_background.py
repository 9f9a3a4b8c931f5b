"""``/v1/responses`` background mode and the directory store, through the ``openai`` SDK on a
tiny Qwen2 served by ``tests/server/fault_server.py`` (a ``SLOW-STEP`` prompt holds its
prefill for a while, so a cancel lands while it runs, whatever the machine's speed):
a background response is queued, polled to the same answer a plain request gives, cancelled
mid-run (the engine request aborted, every block back), only background responses cancel;
``--responses-dir`` keeps stored responses across a restart (GET and
``previous_response_id`` work on the new server)."""

from __future__ import annotations

import sys
import time

import openai
import pytest

from helpers import REPO
from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.text]

LAUNCHER = [sys.executable, str(REPO / "tests" / "server" / "fault_server.py")]
NAME = "tiny-qwen2"
POLLS = 600  # x 0.1 s


def start(tiny_models, *args, env=None) -> ServerProcess:
    return ServerProcess(str(tiny_models["qwen2"][0]), "--kv-cache-memory", "16MiB", "--dtype", "float32", *args,
                         name=NAME, launcher=LAUNCHER, env=env)


def poll(client, rid: str, until=("completed", "incomplete", "failed", "cancelled")):
    for _ in range(POLLS):
        resp = client.responses.retrieve(rid)
        if resp.status in until:
            return resp
        time.sleep(0.1)
    raise AssertionError(f"{rid} still {resp.status} after {POLLS / 10:.0f} s")


def test_background_is_polled_to_the_plain_answer_and_cancels_mid_run(tiny_models, tmp_path):
    marker = tmp_path / "slow-started"
    server = start(tiny_models, env={"ATLAS_TEST_SLOW_S": "20", "ATLAS_TEST_SLOW_MARKER": str(marker)})
    try:
        client = server.client()
        plain = client.responses.create(model=NAME, input="Hello there", max_output_tokens=8, temperature=0)
        queued = client.responses.create(model=NAME, input="Hello there", max_output_tokens=8, temperature=0,
                                         background=True)
        assert queued.status in ("queued", "in_progress") and queued.background is True and queued.output == []
        done = poll(client, queued.id)
        assert done.status == plain.status and done.output_text == plain.output_text
        assert done.usage.output_tokens == plain.usage.output_tokens

        slow = client.responses.create(model=NAME, input="SLOW-STEP please", max_output_tokens=8, temperature=0,
                                       background=True)
        for _ in range(POLLS):  # the prefill step has started and is sleeping
            if marker.exists():
                break
            time.sleep(0.1)
        assert marker.exists()
        with pytest.raises(openai.BadRequestError, match="still in_progress"):
            client.responses.create(model=NAME, input="and then?", previous_response_id=slow.id, max_output_tokens=2)
        cancelled = client.responses.cancel(slow.id)
        assert cancelled.status == "cancelled"
        assert poll(client, slow.id).status == "cancelled" and client.responses.retrieve(slow.id).output == []
        for _ in range(POLLS):  # the step ends, the aborted request's blocks come back
            m = server.metrics()
            if m["atlas:num_requests_running"] == 0 and m["atlas:kv_cache_usage_perc"] == 0:
                break
            time.sleep(0.1)
        assert m["atlas:num_requests_running"] == 0 and m["atlas:kv_cache_usage_perc"] == 0
        assert client.responses.cancel(queued.id).status == plain.status  # finished: returned as it is
        with pytest.raises(openai.BadRequestError, match="only background responses can be cancelled"):
            client.responses.cancel(plain.id)
        with pytest.raises(openai.BadRequestError, match="must be stored"):
            client.responses.create(model=NAME, input="x", background=True, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_" + "0" * 32)
    finally:
        assert server.stop() == 0


def test_responses_dir_keeps_stored_responses_across_a_restart(tiny_models, tmp_path):
    store = tmp_path / "responses"
    server = start(tiny_models, "--responses-dir", str(store), "--max-stored-responses", "2")
    try:
        client = server.client()
        first = client.responses.create(model=NAME, input="Hello there", max_output_tokens=6, temperature=0)
        follow = client.responses.create(model=NAME, input="And then?", previous_response_id=first.id,
                                         max_output_tokens=6, temperature=0)
    finally:
        assert server.stop() == 0
    assert sorted(p.name for p in store.iterdir()) == sorted([f"{first.id}.json", f"{follow.id}.json"])
    server = start(tiny_models, "--responses-dir", str(store), "--max-stored-responses", "2")
    try:
        client = server.client()
        assert client.responses.retrieve(first.id).output_text == first.output_text
        again = client.responses.create(model=NAME, input="And then?", previous_response_id=first.id,
                                        max_output_tokens=6, temperature=0)
        assert again.output_text == follow.output_text  # the same conversation, found on disk
        assert not (store / f"{first.id}.json").exists()  # a third response: the oldest file goes (cap 2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
    finally:
        assert server.stop() == 0
