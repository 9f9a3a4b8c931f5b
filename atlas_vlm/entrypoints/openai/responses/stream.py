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
    """The output items so far; the open message (text streamed into it), the calls."""

    def __init__(self, ev: _Events):
        self.ev, self.items, self.message, self.reasoning, self.calls = ev, [], None, "", {}

    def _add_done(self, item: dict) -> list[str]:
        """Events of an item complete at once (reasoning, a function call)."""
        index = len(self.items)
        self.items.append(item)
        added = {**item, "status": "in_progress"}
        if item["type"] == "function_call":
            added["arguments"] = ""
        out = [self.ev("response.output_item.added", output_index=index, item=added)]
        if item["type"] == "function_call":
            ids = {"item_id": item["id"], "output_index": index}
            out.append(self.ev("response.function_call_arguments.delta", **ids, delta=item["arguments"]))
            out.append(self.ev("response.function_call_arguments.done", **ids, name=item["name"],
                               arguments=item["arguments"]))
        return out + [self.ev("response.output_item.done", output_index=index, item=item)]

    def _flush_reasoning(self) -> list[str]:
        text, self.reasoning = self.reasoning, ""
        return self._add_done(reasoning_item(item_id("rs"), text)) if text else []

    def text(self, delta: str) -> list[str]:
        """Events for new answer text (opening the message item first)."""
        out = []
        if self.message is None:
            out += self._flush_reasoning()
            self.message = message_item(item_id("msg"), "")
            self.items.append(self.message)
            index = len(self.items) - 1
            out.append(self.ev("response.output_item.added", output_index=index,
                               item=message_item(self.message["id"], None, "in_progress")))
            out.append(self.ev("response.content_part.added", item_id=self.message["id"], output_index=index,
                               content_index=0, part=text_part("")))
        self.message["content"][0]["text"] += delta
        if delta:
            out.append(self.ev("response.output_text.delta", item_id=self.message["id"],
                               output_index=self.items.index(self.message), content_index=0, delta=delta,
                               logprobs=[]))
        return out

    def tool_call(self, tc: dict) -> None:
        """Fold one chat tool-call delta (``{"index", "id"?, "function": {"name"?, "arguments"?}}``)."""
        call = self.calls.setdefault(tc["index"], {"call_id": None, "name": None, "arguments": ""})
        fn = tc.get("function") or {}
        call["call_id"] = tc.get("id") or call["call_id"]
        call["name"] = fn.get("name") or call["name"]
        call["arguments"] += fn.get("arguments") or ""

    def close(self) -> list[str]:
        """Events closing the message (an empty one when there is neither text nor a call) and
        adding the calls."""
        out = self._flush_reasoning()
        if self.message is None and not self.calls:
            out += self.text("")
        if self.message is not None:
            index, part = self.items.index(self.message), self.message["content"][0]
            ids = {"item_id": self.message["id"], "output_index": index}
            out.append(self.ev("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[]))
            out.append(self.ev("response.content_part.done", **ids, content_index=0, part=part))
            out.append(self.ev("response.output_item.done", output_index=index, item=self.message))
        for _, c in sorted(self.calls.items()):
            out += self._add_done(function_call_item(item_id("fc"), c["call_id"], c["name"], c["arguments"]))
        return out


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
                items.tool_call(tc)
        for e in items.close():
            yield e
        response = finisher.finish(final, items.items, first.num_cached_tokens)
        yield ev(_LAST_EVENT[response["status"]], response=response)
    finally:
        await close_all([it, first])
