"""``AsyncLLM``: an asyncio front over one ``LLMEngine`` for many concurrent callers.

Scope: one engine thread owns the ``LLMEngine``. Every engine call (``add_request``,
``abort_request``, ``step``) runs in that thread, taken from a command queue between steps,
so requests from many clients join the same continuous batch and no lock is needed.
Everything heavy about a new request (tokenizing, image load / resize / patchify,
validation: ``LLMEngine.process_request``) runs before that, in a bounded pool of input
worker threads, so a large input delays only itself; the engine thread only schedules and
steps. Outputs go back to per-request ``asyncio.Queue``s through
``loop.call_soon_threadsafe`` (vLLM's ``AsyncLLM`` / ``RequestOutputCollector`` pattern).

Faults: a step that raises (not one request's fault; those end that request alone with
``finish_reason="error"`` in the sampler) fails every request in flight with
``EngineStepError`` and resets the engine (``LLMEngine.reset``: KV and queues afresh), which
then serves on. After ``max_consecutive_step_failures`` failed steps in a row (or a failed
reset) the engine is dead: ``alive`` turns false, ``on_dead`` is called, and every new
request gets ``EngineDeadError``. The front also measures time to first token and
inter-token latency (seconds, ``time.monotonic``) and keeps a snapshot of the engine's
queues and KV blocks for ``/metrics``; it holds no HTTP logic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from atlas_vlm.engine.request_stream import (SHUTDOWN, EngineDeadError, EngineStepError, QueueFullError,
                                             RequestStream, RequestStreamState, count_tokens, iterate,
                                             settle)
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Asyncio front over an ``LLMEngine`` stepped by one background thread.

    Args:
        engine: a built ``LLMEngine`` (owned by this object from now on).
        max_waiting_requests: refuse new requests with ``QueueFullError`` while this many
            wait (scheduler queue plus being prepared or added); ``None``: no limit.
        stat_logger: optional object with ``on_step(stats, batch_size)``,
            ``on_first_token(seconds, num_prompt_tokens, num_cached_tokens)``,
            ``on_new_tokens(n, seconds_per_token | None)`` and ``on_finish(output)``; called
            from the engine thread.
        input_workers: threads preparing new requests (tokenizing, images) off the engine
            thread; at most this many inputs are processed at once, the others wait.
        max_consecutive_step_failures: failed steps in a row after which the engine is
            declared dead instead of reset again.
        on_dead: called once (from the engine thread) when the engine is declared dead; the
            server uses it to exit non-zero so that its supervisor restarts it.
    """

    def __init__(self, engine, max_waiting_requests: int | None = None, stat_logger=None, input_workers: int = 2,
                 max_consecutive_step_failures: int = 3, on_dead: Callable[[BaseException], None] | None = None):
        if input_workers < 1:
            raise ValueError(f"input_workers must be >= 1, got {input_workers}")
        if max_consecutive_step_failures < 1:
            raise ValueError(f"max_consecutive_step_failures must be >= 1, got {max_consecutive_step_failures}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.stat_logger = stat_logger
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.on_dead = on_dead
        self.num_step_failures = 0  # total failed steps (each followed by a reset or death)
        self._consecutive_failures = 0
        self.stats = engine.stats()  # the engine's snapshot, refreshed after each step (/metrics)
        self._inputs = concurrent.futures.ThreadPoolExecutor(input_workers, thread_name_prefix="atlas-input")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStreamState] = {}  # engine-thread owned
        self._live: dict[str, RequestStreamState] = {}  # event-loop owned: streams handed out, not finished
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
    def dead(self) -> bool:
        """True once the engine failed for good (not after a plain ``shutdown``)."""
        return self._dead is not None

    @property
    def num_waiting(self) -> int:
        """Requests queued but not yet running (scheduler waiting, plus being prepared or added)."""
        return self.engine.num_waiting + self._pending_adds

    def _check_admitting(self) -> None:
        if not self._accepting or self._dead is not None:
            raise EngineDeadError("the engine is shutting down" if self._dead is None else f"engine failed: {self._dead}")

    async def add_request(self, prompt, sampling_params: SamplingParams, request_id: str,
                          arrival_time: float | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Prepare one request in an input worker, then queue it; returns an async iterator of
        its ``RequestOutput``s, as ``sampling_params.output_kind`` asks (CUMULATIVE: ``text`` /
        ``token_ids`` so far; DELTA: each step's new ones; FINAL_ONLY: the last one only); the
        last one has ``finish_reason`` set. Cancelling the caller while it waits leaves nothing
        queued.

        Raises (nothing is queued):
            QueueFullError: over ``max_waiting_requests``.
            EngineDeadError: shut down or the engine failed.
            RequestTooLongError, ImageInputError, ValueError, TypeError: from
                ``LLMEngine.process_request`` / ``add_request``, unchanged.
        """
        self._check_admitting()
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (--max-waiting-requests "
                                 f"{self.max_waiting_requests}); try again later")
        loop = asyncio.get_running_loop()
        self._pending_adds += 1
        posted = False
        try:
            req = await self._in_worker(self.engine.process_request, prompt, sampling_params, request_id, lora_request)
            self._check_admitting()
            done = loop.create_future()
            stream = RequestStreamState(asyncio.Queue(), loop, arrival_time or time.monotonic(),
                                        req.sampling_params.output_kind)
            self._post(("add", req, stream, done))
            posted = True
            while not done.done():  # the engine's answer; a thread that stopped meanwhile never gives one
                await asyncio.wait({done}, timeout=1.0)
                if not done.done() and not self._thread.is_alive():
                    self._check_admitting()
                    raise EngineDeadError("the engine thread stopped")
            done.result()  # raises the engine's error (a request id in use), if any
        except asyncio.CancelledError:
            if posted:  # the caller left while the add was in flight: do not let it run for nobody
                self.abort(request_id)
            raise
        finally:
            self._pending_adds -= 1
        self._live[request_id] = stream
        return RequestStream(request_id, stream, iterate(request_id, stream, self._release), self._release)

    async def validate_prompts(self, prompts: list, sampling_params: SamplingParams) -> list:
        """Check every prompt (``LLMEngine.validate_prompt``, in the input workers) before
        any is admitted, so that a request with one bad prompt starts none.

        Returns:
            one ``ProcessedPrompt`` per prompt, to pass to :meth:`add_request`.

        Raises:
            the first failing prompt's error (as ``add_request``), with ``prompt_index`` set
            on it; EngineDeadError: shut down.
        """
        self._check_admitting()
        jobs = [self._in_worker(self.engine.validate_prompt, p, sampling_params) for p in prompts]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                r.prompt_index = i
                raise r
        return results

    def _in_worker(self, fn, *args) -> asyncio.Future:
        try:
            return asyncio.get_running_loop().run_in_executor(self._inputs, fn, *args)
        except RuntimeError:  # the input pool was shut down meanwhile
            self._check_admitting()
            raise

    def _release(self, request_id: str, stream: RequestStreamState) -> None:
        """A caller is done with a stream (read to the end, closed, or dropped unread): it is
        no longer live, and an unfinished request is aborted (its KV blocks freed)."""
        if self._live.get(request_id) is stream:
            del self._live[request_id]
        if not stream.finished:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its stream ends with
        ``finish_reason="abort"`` and its KV blocks are freed at the engine's next turn."""
        self._post(("abort", request_id))

    def shutdown(self) -> None:
        """Stop admitting; every stream handed out ends at once with ``finish_reason="abort"``
        (even while a long step runs); the engine thread aborts its requests and stops after
        its current step. Safe to call from a signal handler or another thread, and twice."""
        self._accepting = False
        for stream in list(self._live.values()):
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, SHUTDOWN)
            except RuntimeError:  # its event loop is closed (after the server stopped): nobody reads it
                pass
        self._inputs.shutdown(wait=False, cancel_futures=True)
        self._post(("shutdown",))

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to stop; True if it did within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._drain_commands():
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._consecutive_failures = 0
                else:
                    self._wake.wait()
                    self._wake.clear()
            except Exception as e:  # noqa: BLE001 - a step fault fails the requests in flight, then reset or die
                if not self._recover(e):
                    return
            except BaseException as e:  # noqa: BLE001 - not recoverable (KeyboardInterrupt, SystemExit)
                self._die(e)
                raise

    def _recover(self, error: Exception) -> bool:
        """Fail every request in flight with ``EngineStepError`` and reset the engine. False
        (the engine is dead) after too many failures in a row or if the reset fails."""
        self.num_step_failures += 1
        self._consecutive_failures += 1
        dying = self._consecutive_failures >= self.max_consecutive_step_failures
        if dying:  # refuse new requests before anyone hears of this fault
            self._dead, self._accepting = error, False
        logger.error("engine step failed (%d in a row); failing %d request(s) in flight",
                     self._consecutive_failures, len(self._streams), exc_info=error)
        fault = EngineStepError(f"the engine step failed ({type(error).__name__}: {error}); every request in "
                                f"flight at that moment was failed")
        for rid in list(self._streams):
            self._deliver(rid, fault)
        if dying:
            self._die(error)
            return False
        try:
            self.engine.reset()
            self._snapshot(0)
        except Exception as e:  # noqa: BLE001 - cannot even reset: dead
            self._die(e)
            return False
        return True

    def _die(self, error: BaseException) -> None:
        self._dead = error
        self._accepting = False
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"engine failed: {type(error).__name__}: {error}"))
        logger.error("engine is dead after %d failed step(s) in a row: %s", self._consecutive_failures, error)
        if self.on_dead is not None:
            try:
                self.on_dead(error)
            except Exception:  # noqa: BLE001 - the callback must not hide the death
                logger.exception("on_dead callback failed")

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

    def _do_add(self, req, stream: RequestStreamState, done: asyncio.Future) -> None:
        try:
            rid = self.engine.add_request(req)
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
        if self.stat_logger is not None:  # every stream: a FINAL_ONLY one has no output until it ends
            by_id = {out.request_id: out for out in outputs}
            for rid, stream in self._streams.items():
                count_tokens(self.stat_logger, stream, by_id.get(rid), now)
        for out in outputs:
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
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed (interpreter exit): nobody to tell
            pass

    def _snapshot(self, batch_size: int) -> None:
        self.stats = self.engine.stats()
        if self.stat_logger is not None and batch_size:
            self.stat_logger.on_step(self.stats, batch_size)


__all__ = ["AsyncLLM", "EngineDeadError", "EngineStepError", "QueueFullError", "RequestStream"]
