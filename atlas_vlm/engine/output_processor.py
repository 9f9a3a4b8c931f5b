"""``OutputProcessor``: turns each step's new token ids into ``RequestOutput``s: incremental
detokenizing, stop strings and stream deltas, one per-request state (vLLM's
vllm/v1/engine/output_processor.py and detokenizer.py).

Rules, per request and step:

- the text is ``tokenizer.decode(output_ids, skip_special_tokens=True)`` (with the
  tokenizer's own ``clean_up_tokenization_spaces``), built incrementally (``detokenizer``);
- stop strings are searched in the new text plus a look-back of the longest stop string
  minus one (vLLM ``check_stop_strings``); the first one found ends the request with
  ``finish_reason="stop"`` and the text is cut where it starts (the stop string excluded);
- streamed text never shows what a later step could remove: a suffix that could still grow
  into a stop string, an incomplete UTF-8 character and text a clean-up could still change
  are held back until they cannot; at the end everything left is sent, so the concatenated
  ``new_text`` of all outputs equals the final ``text`` at every step;
- what an output holds follows ``SamplingParams.output_kind`` (vLLM ``RequestOutputKind``):
  CUMULATIVE everything so far (a snapshot of the growing id / logprob lists; the prompt ids
  list is shared, not copied), DELTA only the step's new text / ids / logprobs (prompt ids in
  the first output only), FINAL_ONLY one output at the end. Nothing that a kind does not
  hand out is copied, so a DELTA stream costs O(new tokens) per step, not O(length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas_vlm.engine.detokenizer import CleanupStream, IncrementalDetokenizer
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.sampling_params import RequestOutputKind


def _hold_back(text: str, start: int, stops: list[str]) -> int:
    """Smallest ``s >= start`` such that ``text[s:]`` could still grow into a stop string
    (a proper prefix of one); ``len(text)`` if none. Looks back at most the longest stop."""
    if not stops:
        return len(text)
    lo = max(start, len(text) - max(map(len, stops)) + 1)
    for s in range(lo, len(text)):
        tail = text[s:]
        if any(stop[0] == tail[0] and stop.startswith(tail) for stop in stops):
            return s
    return len(text)


@dataclass
class RequestOutputState:
    """What the processor keeps per request: detokenizer state, how much text is released
    (past the hold-back) and how much of the text / ids / logprobs was handed out."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stops: list[str]
    detokenizer: IncrementalDetokenizer
    cleanup: CleanupStream
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    max_stop_len: int = 0
    released: int = 0  # chars of the text past the hold-back (what a stream may show)
    sent_chars: int = 0  # chars handed out (the concatenation of new_text)
    sent_tokens: int = 0  # generated ids handed out
    sent_logprobs: int = 0  # logprob entries handed out
    sent_any: bool = False  # an output was handed out (DELTA: the prompt ids went with it)
    stop_reason: str | None = None  # the stop string that ended the request, if one did
    token_ids: list[int] = field(default_factory=list)  # generated ids so far (one growing list)


class OutputProcessor:
    """Per-request detokenizing, stop strings and stream deltas.

    Args:
        tokenizer: the model's transformers tokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestOutputState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    stop: list[str], output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Start tracking a request (``stop``: its stop strings; ``output_kind``: what its
        outputs hold, ``SamplingParams.output_kind``)."""
        stops = list(stop)
        self.states[request_id] = RequestOutputState(
            request_id, prompt, list(prompt_token_ids), stops,
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True), CleanupStream(self.tokenizer),
            kind=output_kind, max_stop_len=max(map(len, stops), default=0),
        )

    def process(self, req, new_token_ids: list[int]) -> tuple[RequestOutput | None, bool]:
        """Take one step's new ids of ``req`` (an ``atlas_vlm.request.Request`` whose
        ``finish_reason`` the scheduler has set if the step ended it). Returns the output
        (None for a FINAL_ONLY request still running) and whether a stop string ended the
        request in this step (the output says ``finish_reason="stop"``; the request itself is
        not written: the caller has the scheduler finish it, ``Scheduler.finish(req, "stop")``,
        the one writer of ``finish_reason``). Several ids (a speculative step's accepted run)
        are detokenized one by one, as the plain decode steps would; a stop string completed by one of them
        drops the ids after it from ``req`` (``Request.drop_last_tokens``) and from the output."""
        state = self.states[req.request_id]
        stopped = False
        was_finished = finish_reason = req.finish_reason
        # several ids (a speculative step's accepted run) go in one by one, as plain decode
        # steps would: a stop string completed by one of them voids the ids after it
        steps = [[t] for t in new_token_ids] if len(new_token_ids) > 1 else [new_token_ids]
        for j, ids in enumerate(steps):
            pending, cut = self._advance(state, ids)  # cut: where a stop string starts in the text
            if cut is not None:
                if j < len(steps) - 1:
                    req.drop_last_tokens(len(steps) - j - 1)
                stopped, finish_reason = was_finished is None, "stop"
                break
        committed = state.cleanup.committed
        if finish_reason is not None:
            text = committed + state.cleanup.tail_text(pending)
            end = len(text) if cut is None else cut
        else:
            text, end = committed, _hold_back(committed, state.released, state.stops)
        if finish_reason is None and state.kind is RequestOutputKind.FINAL_ONLY:
            state.released = end
            return None, stopped
        return self._emit(state, req, text, end, finish_reason), stopped

    @staticmethod
    def _advance(state: RequestOutputState, ids: list[int]) -> tuple[str, int | None]:
        """Detokenize ``ids`` into ``state``; returns the pending text and where the first stop
        string starts in the whole text (None: none)."""
        state.token_ids.extend(ids)
        committed_before = len(state.cleanup.committed)
        stable, pending = state.detokenizer.step(ids)
        state.cleanup.push(stable)
        if state.stops:
            # search only the new text plus a look-back of the longest stop minus one
            window = max(0, committed_before - state.max_stop_len + 1)
            recent = state.cleanup.committed[window:] + state.cleanup.tail_text(pending)
            hits = [(at, s) for s in state.stops if (at := recent.find(s)) != -1]
            if hits:
                at, state.stop_reason = min(hits, key=lambda h: h[0])
                return pending, window + at
        return pending, None

    def finish(self, req) -> RequestOutput:
        """The last output of a request ended outside a step (abort, error): its text is what
        was released so far (for a stream: what was already sent)."""
        state = self.states[req.request_id]
        return self._emit(state, req, state.cleanup.committed, state.released, req.finish_reason)

    def _emit(self, state: RequestOutputState, req, text: str, end: int, finish_reason: str | None) -> RequestOutput:
        """The output showing ``text[:end]`` (the released text; never shorter than before),
        finished with ``finish_reason`` (None: still running)."""
        if end < state.released:
            raise RuntimeError(f"request {state.request_id!r}: the text would shrink from {state.released} to "
                               f"{end} characters after being released")
        state.released = end
        finished = finish_reason is not None
        if finished:
            del self.states[state.request_id]
        asked = req.sampling_params.logprobs is not None
        new_text = text[state.sent_chars:end]
        new_ids = state.token_ids[state.sent_tokens:]
        if state.kind is RequestOutputKind.DELTA:
            prompt_ids = [] if state.sent_any else state.prompt_token_ids
            out_text, out_ids = new_text, list(new_ids)  # its own list: RequestOutput.add extends it
            lps = req.logprobs[state.sent_logprobs:] if asked else None
            tops = req.top_logprobs[state.sent_logprobs:] if asked else None
        else:  # CUMULATIVE (a snapshot unless nothing will change it any more) or FINAL_ONLY
            prompt_ids = state.prompt_token_ids  # never changes: shared, not copied
            out_text = text[:end]
            out_ids = state.token_ids if finished else list(state.token_ids)
            lps = (req.logprobs if finished else list(req.logprobs)) if asked else None
            tops = (req.top_logprobs if finished else list(req.top_logprobs)) if asked else None
        state.sent_chars, state.sent_tokens, state.sent_any = end, len(state.token_ids), True
        state.sent_logprobs = len(req.logprobs)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=prompt_ids,
            text=out_text, token_ids=out_ids, finish_reason=finish_reason, logprobs=lps, top_logprobs=tops,
            error=getattr(req, "error", None), new_token_ids=new_ids, new_text=new_text,
            embedding=getattr(req, "embedding", None),
            stop_reason=state.stop_reason if finished else None,
            spec_decode=dict(req.spec_decode) if getattr(req, "spec_decode", None) is not None else None,
        )
