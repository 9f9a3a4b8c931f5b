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
  ``new_text`` of all outputs equals the final ``text`` at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas_vlm.engine.detokenizer import CleanupStream, IncrementalDetokenizer
from atlas_vlm.outputs import RequestOutput


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
    """What the processor keeps per request: detokenizer state and what was already sent."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stops: list[str]
    detokenizer: IncrementalDetokenizer
    cleanup: CleanupStream
    max_stop_len: int = 0
    sent_text: str = ""  # text already handed to the caller (concatenation of new_text)
    sent_tokens: int = 0  # generated ids already handed to the caller
    token_ids: list[int] = field(default_factory=list)  # generated ids so far


class OutputProcessor:
    """Per-request detokenizing, stop strings and stream deltas.

    Args:
        tokenizer: the model's transformers tokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestOutputState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    stop: list[str]) -> None:
        """Start tracking a request (``stop``: its stop strings)."""
        stops = list(stop)
        self.states[request_id] = RequestOutputState(
            request_id, prompt, list(prompt_token_ids), stops,
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True), CleanupStream(self.tokenizer),
            max_stop_len=max(map(len, stops), default=0),
        )

    def process(self, req, new_token_ids: list[int]) -> tuple[RequestOutput, bool]:
        """Take one step's new ids of ``req`` (an ``atlas_vlm.request.Request`` whose
        ``finish_reason`` the scheduler has set if the step ended it). Returns the output and
        whether a stop string ended the request in this step (then ``req.finish_reason`` is
        set to "stop" and the caller must free the request)."""
        state = self.states[req.request_id]
        state.token_ids.extend(new_token_ids)
        before = len(state.cleanup.committed)
        stable, pending = state.detokenizer.step(new_token_ids)
        state.cleanup.push(stable)
        stopped = False
        was_finished = req.finish_reason is not None
        cut = None  # where a stop string starts in the whole text
        if state.stops:
            # search only the new text plus a look-back of the longest stop minus one
            window = max(0, before - state.max_stop_len + 1)
            recent = state.cleanup.committed[window:] + state.cleanup.tail_text(pending)
            hits = [at for at in (recent.find(s) for s in state.stops) if at != -1]
            if hits:
                cut = window + min(hits)
                stopped = not was_finished
                req.finish_reason = "stop"
        if req.finish_reason is not None:
            text = state.cleanup.committed + state.cleanup.tail_text(pending)
            text = text if cut is None else text[:cut]
        else:
            committed = state.cleanup.committed
            text = committed[:_hold_back(committed, len(state.sent_text), state.stops)]
        return self._emit(state, req, text), stopped

    def finish(self, req) -> RequestOutput:
        """The last output of a request ended outside a step (abort, error): text stays what
        was already sent."""
        state = self.states[req.request_id]
        return self._emit(state, req, state.sent_text)

    def _emit(self, state: RequestOutputState, req, text: str) -> RequestOutput:
        if not text.startswith(state.sent_text):
            raise RuntimeError(f"request {state.request_id!r}: streamed text {state.sent_text!r} is not a "
                               f"prefix of the text {text!r}")
        new_text, state.sent_text = text[len(state.sent_text):], text
        new_ids = state.token_ids[state.sent_tokens:]
        state.sent_tokens = len(state.token_ids)
        if req.finish_reason is not None:
            del self.states[state.request_id]
        asked = req.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=list(state.prompt_token_ids),
            text=text, token_ids=list(state.token_ids), finish_reason=req.finish_reason,
            logprobs=list(req.logprobs) if asked else None,
            top_logprobs=list(req.top_logprobs) if asked else None,
            error=getattr(req, "error", None), new_token_ids=new_ids, new_text=new_text,
        )
