"""The ``/v1/files`` store and the batch objects on disk, without a server: what a store
opened on a kept directory lists, and how batches left unfinished by a stopped server come back."""

from __future__ import annotations

import asyncio
import json

import pytest

from atlas_vlm.entrypoints.openai.batch.files import FileStore
from atlas_vlm.entrypoints.openai.batch.jobs import BatchJobs
from atlas_vlm.entrypoints.openai.protocol import APIError


class _Upload:
    """What ``FileStore.upload`` reads: ``filename`` and ``async read(n)``."""

    def __init__(self, data: bytes, filename: str = "in.jsonl"):
        self.data, self.filename = data, filename

    async def read(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk


@pytest.mark.text
def test_a_kept_directory_lists_its_files_again_and_nothing_else(tmp_path):
    store = FileStore(tmp_path, max_file_bytes=10)
    kept = asyncio.run(store.upload(_Upload(b"0123456789"), "batch"))
    with pytest.raises(APIError) as too_big:
        asyncio.run(store.upload(_Upload(b"0123456789x"), "batch"))
    assert too_big.value.status == 413 and too_big.value.code == "file_too_large"
    (tmp_path / "file-notanid.json").write_text("{}")  # not a store id: never listed
    (tmp_path / ("file-" + "0" * 32 + ".json")).write_text("{broken")
    again = FileStore(tmp_path)
    assert [o["id"] for o in again.list()["data"]] == [kept["id"]]
    assert again.path(kept["id"]).read_bytes() == b"0123456789"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("part-")) == []  # the refused upload left nothing
    with pytest.raises(APIError) as unknown:
        again.path("../" + kept["id"])
    assert unknown.value.status == 404


@pytest.mark.text
def test_batches_a_stopped_server_left_running_come_back_failed(tmp_path):
    files = FileStore(tmp_path)
    running = {"id": "batch_1", "object": "batch", "status": "in_progress", "created_at": 1,
               "request_counts": {"total": 3, "completed": 1, "failed": 0}}
    done = {"id": "batch_2", "object": "batch", "status": "completed", "created_at": 2,
            "request_counts": {"total": 1, "completed": 1, "failed": 0}}
    for b in (running, done):
        (tmp_path / f"{b['id']}.json").write_text(json.dumps(b))
    (tmp_path / "batch_3.json").write_text("[1, 2]")  # not a batch object: skipped
    jobs = BatchJobs(None, files)
    assert [b["id"] for b in jobs.list()["data"]] == ["batch_2", "batch_1"]  # newest first
    assert jobs.get("batch_2") == done
    came_back = jobs.get("batch_1")
    assert came_back["status"] == "failed" and came_back["errors"]["data"][0]["code"] == "server_stopped"
    assert json.loads((tmp_path / "batch_1.json").read_text())["status"] == "failed"  # saved so
    with pytest.raises(APIError) as gone:
        jobs.get("batch_3")
    assert gone.value.status == 404
