"""``OutputRouter``: hands each engine step's outputs to the queue of the call that owns the
request, whatever call (iterator, thread) stepped the engine.

Every ``LLM.generate`` / ``LLM.chat`` call registers its request ids with one queue. A call
that needs an output and finds its queue empty takes the router lock, steps the engine once
and dispatches every output of that step to its owner's queue, in step order. Stepping is
thus serialised, and two streams in one thread, or calls in several threads, all progress.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

from atlas_vlm.outputs import RequestOutput
from atlas_vlm.sampling_params import RequestOutputKind


class OutputRouter:
    """Routes outputs of ``engine.step()`` to per-call queues.

    Args:
        engine: the ``LLMEngine`` (its methods are thread-safe on their own).
    """

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()  # one stepper at a time; step + dispatch stay in order
        self._owners: dict[str, queue.SimpleQueue] = {}
        self._last: dict[str, RequestOutput] = {}  # last output seen per routed request
        self._delta: set[str] = set()  # routed requests whose outputs are DELTAs

    def add_request(self, prompt, sampling_params, q: queue.SimpleQueue, lora_request=None) -> str:
        """``engine.add_request`` and route the request's outputs to ``q``, atomically (no
        step can run between the two). Raises what ``add_request`` raises."""
        with self._lock:
            rid = self.engine.add_request(prompt, sampling_params, lora_request=lora_request)
            self._owners[rid] = q
            if getattr(sampling_params, "output_kind", None) is RequestOutputKind.DELTA:
                self._delta.add(rid)
            return rid

    def unregister(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._owners.pop(rid, None)
                self._last.pop(rid, None)
                self._delta.discard(rid)

    def next_output(self, q: queue.SimpleQueue, pending: set[str]) -> RequestOutput:
        """The next output for the call that owns ``q`` (whose unfinished ids are ``pending``),
        stepping the engine when none is queued.

        If the engine no longer knows any of ``pending`` and nothing is queued for them (their
        final output went to a caller outside the router, e.g. a direct ``engine.step()``),
        an ``abort`` output is made for one of them instead of waiting forever.
        """
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if not q.empty():
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    owner = self._owners.get(out.request_id)
                    if owner is not None:
                        self._last[out.request_id] = out
                        owner.put(out)
                if outputs or not q.empty():
                    continue
                lost = [rid for rid in pending if rid not in self.engine.requests]
                if lost:
                    return self._lost(lost[0])

    def _lost(self, rid: str) -> RequestOutput:
        last = self._last.get(rid)
        if last is None:
            return RequestOutput(rid, None, [], finish_reason="abort")
        if rid in self._delta:  # everything was already handed out: an empty last delta
            return RequestOutput(rid, last.prompt, [], finish_reason="abort")
        return RequestOutput(rid, last.prompt, last.prompt_token_ids, text=last.text,
                             token_ids=list(last.token_ids), finish_reason="abort")
