"""``AsyncLLM``: an asyncio front over one ``LLMEngine`` for many concurrent callers.

Scope: one engine thread owns the ``LLMEngine``. Every engine call (``add_request``,
``abort_request``, ``step``) runs in that thread, taken from a command queue between steps,
so requests from many clients join the same continuous batch and no lock is needed.
Outputs go back to per-request ``asyncio.Queue``s through ``loop.call_soon_threadsafe``
(vLLM's ``AsyncLLM`` / ``RequestOutputCollector`` pattern). The front also measures
time to first token and inter-token latency (seconds, ``time.monotonic``) and keeps a
snapshot of the engine's queues and KV blocks for ``/metrics``; it holds no HTTP logic.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator

from atlas_vlm.engine.request_stream import (EngineDeadError, EngineStats, QueueFullError, RequestStream,
                                             RequestStreamState, settle)
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.sampling_params import SamplingParams


class AsyncLLM:
    """Asyncio front over an ``LLMEngine`` stepped by one background thread.

    Args:
        engine: a built ``LLMEngine`` (owned by this object from now on).
        max_waiting_requests: refuse new requests with ``QueueFullError`` while this many
            wait (scheduler queue plus not yet added); ``None``: no limit.
        stat_logger: optional object with ``on_step(stats, batch_size)``,
            ``on_first_token(seconds, num_prompt_tokens, num_cached_tokens)``,
            ``on_new_tokens(n, seconds_per_token | None)`` and ``on_finish(output)``; called
            from the engine thread.
    """

    def __init__(self, engine, max_waiting_requests: int | None = None, stat_logger=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.stat_logger = stat_logger
        self.stats = EngineStats(num_blocks=engine.block_manager.num_blocks,
                                 num_free_blocks=engine.block_manager.num_free_blocks)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStreamState] = {}  # engine-thread owned
        self._pending_adds = 0
        self._accepting = True
        self._dead: BaseException | None = None
        self._batch_size = 0  # requests in the last forward (ModelRunner observer)
        engine.runner.observers.append(self._observe_forward)
        self._thread = threading.Thread(target=self._run, name="atlas-engine", daemon=True)
        self._thread.start()

    # ---- caller side (event loop) -------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the engine thread runs and new requests are admitted."""
        return self._accepting and self._dead is None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests queued but not yet running (scheduler waiting plus adds in flight)."""
        return len(self.engine.scheduler.waiting) + self._pending_adds

    async def add_request(self, prompt, sampling_params: SamplingParams, request_id: str,
                          arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Queue one request; returns an async iterator of its ``RequestOutput``s (cumulative
        ``text`` / ``token_ids``; the last one has ``finish_reason`` set).

        Raises (nothing is queued):
            QueueFullError: over ``max_waiting_requests``.
            EngineDeadError: shut down or the engine failed.
            RequestTooLongError, ImageInputError, ValueError, TypeError: from
                ``LLMEngine.add_request``, unchanged.
        """
        if not self._accepting or self._dead is not None:
            raise EngineDeadError("the engine is shutting down" if self._dead is None else f"engine failed: {self._dead}")
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (--max-waiting-requests "
                                 f"{self.max_waiting_requests}); try again later")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        stream = RequestStreamState(asyncio.Queue(), loop, arrival_time or time.monotonic())
        self._pending_adds += 1
        try:
            self._post(("add", prompt, sampling_params, request_id, stream, done))
            await done  # raises the engine's validation error, if any
        finally:
            self._pending_adds -= 1
        return RequestStream(request_id, stream, self._iterate(request_id, stream), self.abort)

    async def _iterate(self, request_id: str, stream: RequestStreamState) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if not stream.finished:  # the caller went away (disconnect, cancel): free its blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its stream ends with
        ``finish_reason="abort"`` and its KV blocks are freed at the engine's next turn."""
        self._post(("abort", request_id))

    def shutdown(self) -> None:
        """Stop admitting, abort every in-flight request, stop the engine thread."""
        self._accepting = False
        self._post(("shutdown",))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._drain_commands():
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - an engine failure ends every stream, not silently
            self._dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
            raise

    def _drain_commands(self) -> bool:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "add":
                self._do_add(*cmd[1:])
            elif cmd[0] == "abort":
                self._do_abort(cmd[1])
            else:  # shutdown
                for rid in list(self._streams):
                    self._do_abort(rid)
                return False

    def _do_add(self, prompt, params, request_id, stream: RequestStreamState, done: asyncio.Future) -> None:
        try:
            rid = self.engine.add_request(prompt, params, request_id)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who maps it to HTTP 400
            stream.loop.call_soon_threadsafe(settle, done, e)
            return
        stream.request = getattr(self.engine, "requests", {}).get(rid)  # for its prefix-cache hits
        self._streams[rid] = stream
        stream.loop.call_soon_threadsafe(settle, done, None)

    def _do_abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None and request_id in self._streams:
            self._deliver(request_id, out)
        self._snapshot(0)

    def _observe_forward(self, chunks, inp, logits, sampled) -> None:
        self._batch_size = len(chunks)

    def _step(self) -> None:
        self._batch_size = 0
        outputs = self.engine.step()
        now = time.monotonic()
        self._snapshot(self._batch_size)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            n_new = len(out.token_ids) - stream.num_tokens_seen
            if n_new > 0 and self.stat_logger is not None:
                if stream.last_token_time is None:
                    req = stream.request
                    self.stat_logger.on_first_token(now - stream.arrival, len(out.prompt_token_ids),
                                                    getattr(req, "num_cached_tokens", 0))
                    self.stat_logger.on_new_tokens(n_new, None)
                else:
                    self.stat_logger.on_new_tokens(n_new, (now - stream.last_token_time) / n_new)
            if n_new > 0:
                stream.last_token_time, stream.num_tokens_seen = now, len(out.token_ids)
            self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
            stream.finished = True
            if self.stat_logger is not None and not isinstance(item, BaseException):
                self.stat_logger.on_finish(item)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _snapshot(self, batch_size: int) -> None:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        self.stats = EngineStats(len(sched.running), len(sched.waiting), bm.num_blocks, bm.num_free_blocks,
                                 sched.num_preemptions)
        if self.stat_logger is not None and batch_size:
            self.stat_logger.on_step(self.stats, batch_size)


__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError", "RequestStream"]
