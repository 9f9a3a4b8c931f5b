"""The pieces ``AsyncLLM`` hands to callers and keeps per request: its error types, the
engine snapshot for ``/metrics``, per-request stream state and ``RequestStream`` (the async
iterator ``AsyncLLM.add_request`` returns)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from atlas_vlm.outputs import RequestOutput

SHUTDOWN = object()  # put in a stream's queue by ``AsyncLLM.shutdown``: end it now with "abort"


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or an engine step raised)."""


class EngineStepError(RuntimeError):
    """An engine step raised unexpectedly (not one request's fault): every request in flight
    at that moment fails with this error (HTTP 500), then the engine is reset and serves on."""


class QueueFullError(RuntimeError):
    """More requests wait than ``max_waiting_requests`` allows (HTTP 503)."""


@dataclass
class EngineStats:
    """Snapshot of the engine after a step (read by ``/metrics``)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0


@dataclass
class RequestStreamState:
    """Per-request state shared by the engine thread and the caller's iterator."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    request: object = None  # the engine's Request (prefix-cache hits), set in the engine thread
    last_token_time: float | None = None
    num_tokens_seen: int = 0
    finished: bool = False
    extra: dict = field(default_factory=dict)


class RequestStream:
    """What ``AsyncLLM.add_request`` returns: an async iterator of ``RequestOutput``
    (``async for out in stream``). However the caller is done with it (read to the end,
    left early, closed, or dropped without ever reading), ``release`` runs: the stream is
    no longer live and an unfinished request is aborted, its KV blocks freed."""

    def __init__(self, request_id: str, stream: RequestStreamState, iterator: AsyncIterator[RequestOutput],
                 release: Callable[[str, RequestStreamState], None]):
        self.request_id = request_id
        self._stream = stream
        self._iterator = iterator
        self._release = release

    def __aiter__(self):
        return self._iterator

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served by prefix-cache hits at admission (0 before admission)."""
        return getattr(self._stream.request, "num_cached_tokens", 0)

    def __del__(self):  # never iterated nor closed: do not let the request run for nobody
        try:
            self._release(self.request_id, self._stream)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
            pass

    async def aclose(self) -> None:
        """Stop reading; an unfinished request is aborted (also when never iterated: closing
        an async generator that never started does not run its ``finally``)."""
        await self._iterator.aclose()
        self._release(self.request_id, self._stream)


async def iterate(request_id: str, stream: RequestStreamState,
                  release: Callable[[str, RequestStreamState], None]) -> AsyncIterator[RequestOutput]:
    """The outputs the engine thread puts in ``stream.queue`` until the finished one; an
    error put there is raised; ``SHUTDOWN`` ends it at once with ``finish_reason="abort"``.
    ``release`` runs however the iteration ends."""
    last: RequestOutput | None = None
    try:
        while True:
            out = await stream.queue.get()
            if out is SHUTDOWN:  # end now, whatever the engine thread is doing
                stream.finished = True
                base = last or RequestOutput(request_id, None, [])
                yield dataclasses.replace(base, finish_reason="abort", new_token_ids=[], new_text="")
                return
            if isinstance(out, BaseException):
                raise out
            last = out
            yield out
            if out.finished:
                return
    finally:
        release(request_id, stream)


def settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
