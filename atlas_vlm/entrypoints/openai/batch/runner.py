"""Run a batch's request lines on the engine: each line through the same serving function as
its HTTP route (``create_chat_completion``, ``create_completion``, ``create_embedding``), at
most ``max_in_flight`` at once (the engine batches them together, and with live traffic when
served), the input read one line at a time, so memory stays bounded for any input size.

Every non-blank input line gets exactly one record (``lines.success_record`` or
``lines.error_record``) unless the run is stopped: a bad line is a per-line 400, an endpoint
error its own status. Lines already recorded (``ResultFiles.done_ids`` / ``done_lines``) are
skipped. When the queue is full (503 ``queue_full``) a line waits and retries; a dead engine
stops the run (``EngineDeadError``) with the unfinished lines left unrecorded, for a rerun.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from pydantic import ValidationError

from atlas_vlm.engine.request_stream import EngineDeadError, EngineStepError, QueueFullError
from atlas_vlm.entrypoints.openai.batch.lines import (BatchLine, LineError, duplicate_error, error_record,
                                                      parse_line, success_record)
from atlas_vlm.entrypoints.openai.batch.results import ResultFiles
from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from atlas_vlm.entrypoints.openai.serving_chat import create_chat_completion
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, engine_error
from atlas_vlm.entrypoints.openai.serving_completion import create_completion
from atlas_vlm.entrypoints.openai.serving_embedding import EmbeddingRequest, create_embedding

logger = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
             "/v1/completions": (CompletionRequest, create_completion),
             "/v1/embeddings": (EmbeddingRequest, create_embedding)}
DEFAULT_MAX_IN_FLIGHT = 64  # lines running at once
QUEUE_FULL_RETRY_S = 0.5  # wait before a line refused by a full queue tries again
YIELD_EVERY = 256  # input lines read between two yields to the event loop (a server serves on meanwhile)


async def _answer(ctx: ServerContext, item: BatchLine) -> dict:
    """The endpoint's response body for ``item`` (retried while the engine's queue is full).

    Raises:
        APIError: the error the HTTP route would answer (400 body, 404 model, 500 engine...).
        EngineDeadError: the answer was aborted (the engine is shutting down).
    """
    request_cls, create = ENDPOINTS[item.url]
    try:
        req = request_cls.model_validate(item.body)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None
    if getattr(req, "stream", False):
        raise APIError(400, "stream is not supported in a batch (each line's answer is one JSON object)",
                       "stream", "invalid_value")
    while True:
        try:
            async with ctx.lease(req.model) as model_ctx:  # several models: the line's ``model`` picks its engine
                body = await create(model_ctx, req)
            break
        except APIError as e:
            if e.code != "queue_full":
                raise
        await asyncio.sleep(QUEUE_FULL_RETRY_S)
    if any(c.get("finish_reason") == "abort" for c in body.get("choices", ())):
        # a batch line has no client to leave: only a shutdown aborts it; that is no answer to record
        raise EngineDeadError("the engine is shutting down (a line was aborted)")
    return body


async def execute(ctx: ServerContext, item: BatchLine) -> tuple[bool, dict]:
    """Run one parsed line; returns ``(ok, record)``.

    Raises:
        EngineDeadError: the engine is dead (no record: the line is for a rerun).
    """
    try:
        return True, success_record(item.custom_id, await _answer(ctx, item))
    except APIError as e:
        if e.code == "engine_unavailable":
            raise EngineDeadError(e.message) from e
        return False, error_record(item.custom_id, e)
    except EngineDeadError:
        raise
    except (EngineStepError, QueueFullError) as e:  # a failed step: the line's 500, as the route answers
        return False, error_record(item.custom_id, engine_error(e))
    except Exception as e:  # noqa: BLE001 - one line's fault is that line's record, as the route's 500
        logger.exception("batch line %d (custom_id %r) failed", item.line, item.custom_id)
        err = APIError(500, f"internal server error ({type(e).__name__})", None, "internal_error")
        return False, error_record(item.custom_id, err)


async def run_lines(ctx: ServerContext, source: Iterable[tuple[int, bytes]], results: ResultFiles, *,
                    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, endpoint: str | None = None,
                    on_record: Callable[[bool, dict], None] | None = None,
                    on_skip: Callable[[], None] | None = None) -> None:
    """Run every line of ``source`` (``(line_number, raw_bytes)``, read lazily) into ``results``.

    Args:
        max_in_flight: lines running at once (>= 1).
        endpoint: the only ``url`` accepted (``/v1/batches``), None for any supported one.
        on_record: called with ``(ok, record)`` after each record is written (progress, counts).
        on_skip: called for each line skipped as already recorded.

    Raises:
        ValueError: ``max_in_flight`` < 1.
        EngineDeadError: the engine died (lines recorded so far stay; a rerun does the rest).
        asyncio.CancelledError: cancelled (the lines running are aborted, not recorded).
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    slots = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task] = set()
    seen: set[str] = set()  # custom_ids met in this pass
    dead: list[BaseException] = []

    def skip() -> None:
        if on_skip is not None:
            on_skip()

    def record(ok: bool, rec: dict) -> None:
        results.write(rec, ok)
        if on_record is not None:
            on_record(ok, rec)

    async def one(item: BatchLine) -> None:
        try:
            record(*await execute(ctx, item))
        except EngineDeadError as e:
            dead.append(e)
        finally:
            slots.release()

    try:
        for line_no, raw in source:
            if dead:
                break
            if line_no % YIELD_EVERY == 0:  # lines that start nothing (skipped, bad) never await: let others run
                await asyncio.sleep(0)
            if not raw.strip():
                continue
            if line_no in results.done_lines:
                skip()
                continue
            try:
                item = parse_line(raw, line_no, endpoint)
            except LineError as e:
                item = e
            cid = item.custom_id
            if cid is not None and cid in seen:
                record(False, error_record(cid, duplicate_error(line_no, cid), line=line_no))
                continue
            if cid is not None:
                seen.add(cid)
                if cid in results.done_ids:
                    skip()
                    continue
            if isinstance(item, LineError):
                record(False, error_record(cid, item.error, line=None if cid is not None else line_no))
                continue
            await slots.acquire()
            if dead:  # the engine died while this line waited for a slot
                break
            task = asyncio.create_task(one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*list(tasks))
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*list(tasks), return_exceptions=True)
    if dead:
        raise dead[0]


def read_lines(path) -> Iterable[tuple[int, bytes]]:
    """``(line_number, raw_bytes)`` of ``path``, one line at a time (1-based numbers)."""
    with open(path, "rb") as f:
        yield from enumerate(f, 1)


def count_lines(path) -> int:
    """Non-blank lines of ``path``, read one at a time (a batch's ``request_counts.total``)."""
    return sum(1 for _, raw in read_lines(path) if raw.strip())
