"""A streamed ``/v1/responses`` answer as OpenAI's server-sent events, in OpenAI's order:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added`` ... ``response.output_item.done`` (a message's
``response.content_part.added``, one ``response.output_text.delta`` per engine DELTA with
new text, ``response.output_text.done``, ``response.content_part.done``; a function call's
``response.function_call_arguments.delta`` / ``.done``), and last ``response.completed``
(``response.incomplete`` when cut by ``max_output_tokens``, ``response.failed`` when the
request failed). Each event has ``type`` and ``sequence_number`` (0, 1, ...)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from atlas_vlm.engine.async_llm import EngineDeadError, EngineStepError, QueueFullError
from atlas_vlm.entrypoints.openai.protocol import APIError, printable
from atlas_vlm.entrypoints.openai.responses.output import (function_call_item, item_id, message_item,
                                                           reasoning_item, text_part)
from atlas_vlm.entrypoints.openai.serving_common import close_all, engine_error, merge, until_error

_LAST_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
               "cancelled": "response.incomplete", "failed": "response.failed"}


class _Events:
    """Numbers events and writes them as SSE (``event:`` line, then the JSON ``data:``)."""

    def __init__(self):
        self.seq = 0

    def __call__(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


class _Items:
    """The output items so far and the one open now (a message taking text, or a function
    call taking argument fragments); opening one closes the other, as OpenAI's stream does."""

    def __init__(self, ev: _Events):
        self.ev, self.items, self.open, self.reasoning = ev, [], None, ""

    def _add(self, item: dict, shown: dict) -> str:
        self.items.append(item)
        return self.ev("response.output_item.added", output_index=len(self.items) - 1, item=shown)

    def _ids(self) -> dict:
        return {"item_id": self.open["id"], "output_index": self.items.index(self.open)}

    def _flush_reasoning(self) -> list[str]:
        text, self.reasoning = self.reasoning, ""
        if not text:
            return []
        item = reasoning_item(item_id("rs"), text)
        added = self._add(item, {**item, "status": "in_progress"})
        return [added, self.ev("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def _close_open(self) -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.ev("response.output_text.done", **self._ids(), content_index=0, text=part["text"],
                               logprobs=[]))
            out.append(self.ev("response.content_part.done", **self._ids(), content_index=0, part=part))
        else:
            out.append(self.ev("response.function_call_arguments.done", **self._ids(), name=item["name"],
                               arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(self.ev("response.output_item.done", output_index=self.items.index(item), item=item))
        self.open = None
        return out

    def text(self, delta: str) -> list[str]:
        """Events for new answer text (closing an open call, opening a message first)."""
        out = []
        if self.open is not None and self.open["type"] != "message":
            out += self._close_open()
        if self.open is None:
            out += self._flush_reasoning()
            self.open = message_item(item_id("msg"), "")
            out.append(self._add(self.open, message_item(self.open["id"], None, "in_progress")))
            out.append(self.ev("response.content_part.added", **self._ids(), content_index=0, part=text_part("")))
        self.open["content"][0]["text"] += delta
        if delta:
            out.append(self.ev("response.output_text.delta", **self._ids(), content_index=0, delta=delta,
                               logprobs=[]))
        return out

    def tool_call(self, tc: dict) -> list[str]:
        """Events for one chat tool-call delta (``{"index", "id", "function": {"name"}}`` once
        per call, then ``{"index", "function": {"arguments"}}`` fragments)."""
        out, fn = [], tc.get("function") or {}
        if tc.get("id"):  # a new call: close what is open, open its item
            out += self._close_open() + self._flush_reasoning()
            self.open = function_call_item(item_id("fc"), tc["id"], fn.get("name") or "", "", "in_progress")
            out.append(self._add(self.open, dict(self.open)))
        if self.open is not None and self.open["type"] == "function_call" and fn.get("arguments"):
            self.open["arguments"] += fn["arguments"]
            out.append(self.ev("response.function_call_arguments.delta", **self._ids(), delta=fn["arguments"]))
        return out

    def close(self) -> list[str]:
        """Events closing the open item (after an empty message when there is neither text
        nor a call)."""
        out = self._flush_reasoning()
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            out += self.text("")
        return out + self._close_open()


async def response_events(it: AsyncIterator, first, view, finisher) -> AsyncIterator[str]:
    """The SSE events of one answer: ``it`` yields its DELTA ``RequestOutput``s, ``view`` (a
    ``ChatChoiceOutput``) splits them into text and tool calls, ``finisher``
    (``serving.Finisher``) builds (and stores) the final response. An engine failure midway
    ends the stream with an ``error`` event and ``response.failed``; leaving early aborts."""
    ev = _Events()
    base = finisher.base
    items, final = _Items(ev), None
    try:
        yield ev("response.created", response=base)
        yield ev("response.in_progress", response=base)
        async for _, out in until_error(merge([it])):
            if isinstance(out, BaseException):
                err = out if isinstance(out, APIError) else engine_error(out) if isinstance(
                    out, (QueueFullError, EngineDeadError, EngineStepError)) else None
                message = printable(err.message if err else str(out))
                yield ev("error", code=err.code if err else "server_error", message=message, param=None)
                yield ev("response.failed", response={**base, "status": "failed",
                                                      "error": {"code": "server_error", "message": message}})
                return
            delta, _ = view.feed_delta(out)
            final = out if final is None else final.add(out)
            items.reasoning += delta.get("reasoning_content", "")
            if delta.get("content"):
                for e in items.text(delta["content"]):
                    yield e
            for tc in delta.get("tool_calls", []):
                for e in items.tool_call(tc):
                    yield e
        for e in items.close():
            yield e
        response = finisher.finish(final, items.items, first.num_cached_tokens)
        yield ev(_LAST_EVENT[response["status"]], response=response)
    finally:
        await close_all([it, first])
