"""The pieces ``AsyncLLM`` hands to callers and keeps per request: its error types, the
engine snapshot for ``/metrics``, per-request stream state and ``RequestStream`` (the async
iterator ``AsyncLLM.add_request`` returns)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from atlas_vlm.outputs import RequestOutput
from atlas_vlm.sampling_params import RequestOutputKind

SHUTDOWN = object()  # put in a stream's queue by ``AsyncLLM.shutdown``: end it now with "abort"


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or an engine step raised)."""


class EngineStepError(RuntimeError):
    """An engine step raised unexpectedly (not one request's fault): every request in flight
    at that moment fails with this error (HTTP 500), then the engine is reset and serves on."""


class QueueFullError(RuntimeError):
    """More requests wait than ``max_waiting_requests`` allows (HTTP 503)."""


@dataclass(frozen=True)
class EngineStats:
    """The engine at one moment (``LLMEngine.stats``; ``AsyncLLM`` keeps the one after each
    step, which ``/metrics`` reads)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0
    # speculative decoding totals (Scheduler.spec_decode_stats): steps with drafts, drafts, accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    disk_kv_hits: int = 0  # blocks loaded from the disk KV tier (kv_cache_dir) since start
    disk_kv_misses: int = 0  # disk KV tier lookups that found no valid block since start
    disk_kv_bytes: int = 0  # bytes of block files in kv_cache_dir (as this engine last saw them)
    # hybrid models' prefix cache (StateSnapshotPool): admissions that looked up a state snapshot,
    # and those restored from one (a hit), since start
    state_snapshot_queries: int = 0
    state_snapshot_hits: int = 0


@dataclass
class RequestStreamState:
    """Per-request state shared by the engine thread and the caller's iterator."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # the request's SamplingParams.output_kind
    request: object = None  # the engine's Request (prefix-cache hits), set in the engine thread
    last_token_time: float | None = None
    first_token_time: float | None = None  # time.monotonic() of the step that gave its first token (access log)
    num_tokens_seen: int = 0  # generated tokens counted so far (metrics)
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
    def state(self) -> RequestStreamState:
        """The request's shared state (arrival, first-token time, the engine's ``Request``)."""
        return self._stream

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
    error put there is raised; ``SHUTDOWN`` ends it at once with ``finish_reason="abort"``
    (a DELTA stream's abort output adds nothing; a CUMULATIVE one repeats the last output).
    ``release`` runs however the iteration ends."""
    last: RequestOutput | None = None
    try:
        while True:
            out = await stream.queue.get()
            if out is SHUTDOWN:  # end now, whatever the engine thread is doing
                stream.finished = True
                base = last or RequestOutput(request_id, None, [])
                if last is not None and stream.output_kind is RequestOutputKind.DELTA:  # all was handed out
                    base = RequestOutput(request_id, last.prompt, [], logprobs=None if last.logprobs is None else [],
                                         top_logprobs=None if last.top_logprobs is None else [])
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


def count_tokens(stat_logger, stream: RequestStreamState, out: RequestOutput | None, now: float) -> None:
    """Report to ``stat_logger`` (``AsyncLLM``'s) the tokens ``stream``'s request generated
    since the last step (the engine's request's count, so that a FINAL_ONLY request with no
    output yet counts too; without one, the output's new ids) and its time to first token
    (seconds since arrival, ``now`` from ``time.monotonic``)."""
    req = stream.request
    if req is not None:
        total, num_prompt = req.num_output_tokens, req.num_prompt_tokens
    elif out is not None:
        total, num_prompt = stream.num_tokens_seen + len(out.new_token_ids), len(out.prompt_token_ids)
    else:
        return
    n_new = total - stream.num_tokens_seen
    if n_new <= 0:
        return
    if stream.last_token_time is None:
        stream.first_token_time = now
        stat_logger.on_first_token(now - stream.arrival, num_prompt, getattr(req, "num_cached_tokens", 0))
        stat_logger.on_new_tokens(n_new, None)
    else:
        stat_logger.on_new_tokens(n_new, (now - stream.last_token_time) / n_new)
    stream.last_token_time, stream.num_tokens_seen = now, total


def settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
