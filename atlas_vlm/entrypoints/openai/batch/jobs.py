"""``/v1/batches`` jobs: each batch runs as a background task on the server's event loop, its
lines on the same engine as live traffic (``runner.run_lines``, at most ``max_in_flight`` at
once), its results written to the file store as ``batch_output`` files.

Statuses (OpenAI's): ``validating`` (counting the input's lines) -> ``in_progress`` ->
``finalizing`` -> ``completed``; ``cancelling`` -> ``cancelled`` (the lines running are
aborted; what finished is in the output / error files); ``failed`` (an empty or unreadable
input, a line that is no request line (not JSONL: ``errors.data`` names each such line, as
OpenAI's validation does), a dead engine, the server stopped: ``errors`` says why). Batch objects are kept beside
the files (``DIR/<batch id>.json``), so a ``--files-dir`` server lists them after a restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid

from atlas_vlm.engine.request_stream import EngineDeadError
from atlas_vlm.entrypoints.openai.batch.files import FileStore
from atlas_vlm.entrypoints.openai.batch.lines import ENDPOINT_URLS, validation_errors
from atlas_vlm.entrypoints.openai.batch.results import ResultFiles
from atlas_vlm.entrypoints.openai.batch.runner import read_lines, run_lines
from atlas_vlm.entrypoints.openai.protocol import APIError, printable
from atlas_vlm.entrypoints.openai.serving_common import ServerContext

logger = logging.getLogger(__name__)

DEFAULT_BATCH_IN_FLIGHT = 16  # lines of one batch running at once (live requests keep their share)
COMPLETION_WINDOWS = ("24h",)  # OpenAI's only window
FINAL = ("completed", "failed", "cancelled", "expired")


class BatchJobs:
    """The server's batches.

    Args:
        ctx: the routes' context (engine front and settings), or a ``router_routes.RoutedContext`` (each
            line's ``model`` picks its engine through ``lease``).
        files: where inputs are read and results stored.
        max_in_flight: lines of one batch running at once (>= 1).
    """

    def __init__(self, ctx: ServerContext, files: FileStore, max_in_flight: int = DEFAULT_BATCH_IN_FLIGHT):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.ctx, self.files, self.max_in_flight = ctx, files, max_in_flight
        self._batches: dict[str, dict] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        for path in sorted(files.root.glob("batch_*.json")):  # kept by an earlier server on this directory
            try:
                batch = json.loads(path.read_text())
                if not isinstance(batch, dict) or batch.get("id") != path.stem:
                    raise ValueError("no batch object with this file's id")
            except (OSError, ValueError) as e:
                logger.warning("%s: not a batch object, skipped (%s)", path, e)
                continue
            if batch.get("status") not in FINAL:  # that server stopped without finishing it
                self._fail(batch, "server_stopped", "the server stopped while this batch ran; run it again")
                self._save(batch)
            self._batches[batch["id"]] = batch
        self._batches = dict(sorted(self._batches.items(), key=lambda kv: kv[1].get("created_at", 0)))

    def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None) -> dict:
        """Start a batch; returns its object (status ``validating``).

        Raises:
            APIError: 400 an unsupported ``endpoint`` / ``completion_window`` or an input file
                whose purpose is not ``batch``; 404 an unknown ``input_file_id``.
        """
        if endpoint not in ENDPOINT_URLS:
            raise APIError(400, f"endpoint {printable(repr(endpoint))} is not supported (supported: "
                           f"{', '.join(ENDPOINT_URLS)})", "endpoint", "invalid_value")
        if completion_window not in COMPLETION_WINDOWS:
            raise APIError(400, f"completion_window {printable(repr(completion_window))} is not supported "
                           f"(supported: {', '.join(COMPLETION_WINDOWS)})", "completion_window", "invalid_value")
        if self.files.get(input_file_id, "input_file_id")["purpose"] != "batch":
            raise APIError(400, f"file {input_file_id} was not uploaded with purpose 'batch'", "input_file_id",
                           "invalid_value")
        now = int(time.time())
        batch = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                 "model": None, "usage": None}
        self._batches[batch["id"]] = batch
        self._save(batch)
        self._tasks[batch["id"]] = asyncio.create_task(self._run(batch))
        return batch

    def get(self, batch_id: str) -> dict:
        """The batch object. Raises APIError(404) for an unknown id."""
        batch = self._batches.get(batch_id)
        if batch is None:
            raise APIError(404, f"No such Batch object: {printable(repr(batch_id))}", None, "batch_not_found")
        return batch

    def list(self, limit: int = 20, after: str | None = None) -> dict:
        """OpenAI's list object, newest first, at most ``limit`` after the batch ``after``."""
        items = list(reversed(self._batches.values()))
        if after is not None:
            ids = [b["id"] for b in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def cancel(self, batch_id: str) -> dict:
        """Cancel a batch that is validating or in progress (status ``cancelling``, then
        ``cancelled`` once its running lines are aborted); a cancelling or cancelled one is
        returned as it is.

        Raises:
            APIError: 404 an unknown id; 409 a batch that is finalizing or already over.
        """
        batch = self.get(batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in ("validating", "in_progress"):
            raise APIError(409, f"batch {batch_id} is {batch['status']}: only a validating or in-progress batch can "
                           "be cancelled", None, "batch_not_cancellable")
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        self._tasks[batch_id].cancel()
        return batch

    async def close(self) -> None:
        """Cancel every running batch and wait for them (server shutdown)."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, batch: dict) -> None:
        counts = batch["request_counts"]
        out, err = self.files.new_part(), self.files.new_part()

        def counted(ok: bool, record: dict) -> None:
            counts["completed" if ok else "failed"] += 1
            if ok:
                add_usage(batch, record["response"]["body"])

        try:
            src = self.files.path(batch["input_file_id"], "input_file_id")
            counts["total"], invalid = await asyncio.to_thread(lambda: validation_errors(read_lines(src)))
            if counts["total"] == 0:
                raise APIError(400, "the input file has no request lines", "input_file_id", "empty_file")
            if invalid:  # not JSONL of request lines: failed at validation, no line run
                counts["total"] = 0
                self._fail(batch, None, "", errors=invalid)
                return
            batch.update(status="in_progress", in_progress_at=int(time.time()))
            with ResultFiles(out, err) as results:
                await run_lines(self.ctx, read_lines(src), results, max_in_flight=self.max_in_flight,
                                endpoint=batch["endpoint"], on_record=counted)
            batch.update(status="finalizing", finalizing_at=int(time.time()))
            self._keep_results(batch, out, err)
            batch.update(status="completed", completed_at=int(time.time()))
        except asyncio.CancelledError:
            self._keep_results(batch, out, err)
            if batch["status"] == "cancelling":
                batch.update(status="cancelled", cancelled_at=int(time.time()))
            else:  # not asked for: the server is shutting down
                self._fail(batch, "server_stopped", "the server stopped while this batch ran; its finished lines "
                           "are in its output and error files")
        except EngineDeadError as e:  # a plain shutdown, or the engine failed for good
            self._keep_results(batch, out, err)
            if getattr(getattr(self.ctx, "engine", None), "dead", False):  # a router has no one engine
                self._fail(batch, "engine_dead", f"the engine failed ({e}); run the batch again on a new server")
            else:
                self._fail(batch, "server_stopped", "the server stopped while this batch ran; its finished lines "
                           "are in its output and error files")
        except Exception as e:  # noqa: BLE001 - the batch fails, the server serves on
            if not isinstance(e, APIError):
                logger.exception("batch %s failed", batch["id"])
            code, message = (e.code, e.message) if isinstance(e, APIError) else (type(e).__name__, str(e))
            self._keep_results(batch, out, err)
            self._fail(batch, code, message)
        finally:
            out.unlink(missing_ok=True)
            err.unlink(missing_ok=True)
            self._save(batch)

    @staticmethod
    def _fail(batch: dict, code: str | None, message: str, errors: list[dict] | None = None) -> None:
        data = errors or [{"code": code, "message": printable(message), "param": None, "line": None}]
        batch.update(status="failed", failed_at=int(time.time()), errors={"object": "list", "data": data})

    def _save(self, batch: dict) -> None:
        """Keep the batch object beside the files (``DIR/<batch id>.json``), for a restart."""
        try:
            tmp = self.files.root / f"{batch['id']}.json.part"
            tmp.write_text(json.dumps(batch))
            os.replace(tmp, self.files.root / f"{batch['id']}.json")
        except OSError as e:  # the batch itself is unharmed; only a restart would not see it
            logger.warning("batch %s: could not save its object (%s)", batch["id"], e)

    def _keep_results(self, batch: dict, out, err) -> None:
        """Store the non-empty result files as ``batch_output`` files of ``batch``."""
        for path, key, name in ((out, "output_file_id", "output"), (err, "error_file_id", "errors")):
            if path.exists() and path.stat().st_size > 0:
                batch[key] = self.files.add(path, f"{batch['id']}_{name}.jsonl", "batch_output")["id"]


def add_usage(batch: dict, body: dict) -> None:
    """Add one answered line's ``usage`` to the batch's (OpenAI's batch ``usage``: input /
    output / total tokens, cached input tokens) and take its ``model`` as the batch's."""
    batch["model"] = batch["model"] or body.get("model")
    u = body.get("usage") or {}
    total = batch["usage"] or {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                               "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}
    total["input_tokens"] += u.get("prompt_tokens", 0)
    total["output_tokens"] += u.get("completion_tokens", 0)
    total["total_tokens"] += u.get("total_tokens", 0)
    total["input_tokens_details"]["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    batch["usage"] = total
