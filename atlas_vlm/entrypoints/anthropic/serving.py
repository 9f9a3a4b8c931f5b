"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the
chat-completions pipeline. The request becomes our OpenAI chat request
(``protocol.to_chat_request``); its prompt, constraint (forced tool call), sampling and
tool parsing are chat completions' own; only the reply is written in Anthropic's shape: a
``message`` object, or server-sent events ``message_start``, ``content_block_start`` /
``_delta`` / ``_stop`` per block, ``message_delta``, ``message_stop`` (Anthropic's
"Streaming Messages" reference). ``usage.input_tokens`` is the whole prompt (prefix-cache
hits included, as vLLM's Anthropic route reports it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from atlas_vlm.entrypoints.anthropic.protocol import (CountTokensRequest, MessagesRequest, anthropic_error, error_body,
                                                      to_chat_request)
from atlas_vlm.entrypoints.openai.chat_output import ChatChoiceOutput
from atlas_vlm.entrypoints.openai.protocol import APIError, printable
from atlas_vlm.entrypoints.openai.serving_chat import chat_constraint, chat_prompt, chat_tool_parser
from atlas_vlm.entrypoints.openai.serving_common import (ServerContext, close_all, collect, engine_error, merge,
                                                         sampling_params, start_choices, until_error)
from atlas_vlm.sampling_params import SamplingParams


def event(name: str, payload: dict) -> str:
    """One Anthropic server-sent event: ``event: NAME\\ndata: JSON\\n\\n``."""
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


def stop_reason(out, stops: list[str] | None, called: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished output: ``max_tokens`` (length),
    ``tool_use`` (tool calls were made), ``stop_sequence`` (one of ``stops`` ended it),
    else ``end_turn``."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if out.stop_reason is not None and out.stop_reason in (stops or []):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _failed(out) -> APIError | None:
    """The error of an output that did not finish normally (its request failed, or the
    server aborted it while shutting down), else None."""
    if out.finish_reason == "error":
        return APIError(400, printable(out.error or "the request failed"))
    if out.finish_reason == "abort":
        return APIError(503, "the request was aborted (the server is shutting down)")
    return None


def _tool_use(call: dict) -> dict:
    args = call["function"]["arguments"]
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        value = {"_arguments": args}  # the parser only emits JSON; kept rather than dropped if ever not
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": value if isinstance(value, dict) else {"value": value}}


async def _chat_prompt(ctx: ServerContext, req, chat) -> dict:
    """Chat completions' prompt dict; a media error names the Anthropic block at fault."""
    try:
        return await chat_prompt(ctx, chat)
    except APIError as e:
        raise anthropic_error(e, req) from e


async def _start(ctx: ServerContext, req: MessagesRequest):
    chat = to_chat_request(req)
    model = ctx.check_model(chat.model)
    constraint = chat_constraint(ctx, chat)
    params = [sampling_params(chat, chat.max_tokens, None, 0, constraint)]
    prompt = await _chat_prompt(ctx, req, chat)
    parser = chat_tool_parser(ctx, chat)
    view = ChatChoiceOutput(ctx.reasoning_parser, parser is not None, parser)
    rid = f"msg_{uuid.uuid4().hex}"
    iters, first = await start_choices(ctx, prompt, params, rid)
    return model, view, rid, iters, first


async def create_message(ctx: ServerContext, req: MessagesRequest):
    """Returns the Anthropic ``message`` dict, or (``stream=True``) an async iterator of its
    SSE events (a failure midway ends it with an ``error`` event).

    Raises:
        APIError: 400 bad input (the message names the field), 404 unknown model, 500
            engine step failed, 503 queue full or shutting down.
    """
    model, view, rid, iters, first = await _start(ctx, req)
    if req.stream:
        return _stream(iters, first, rid, model, view, req.stop_sequences)
    try:
        out = (await collect(iters))[0]
    finally:
        await close_all(iters + [first])
    failed = _failed(out)
    if failed is not None:
        raise failed
    message, _ = view.message(out)
    calls = message.get("tool_calls") or []
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message["content"] or not calls:
        content.append({"type": "text", "text": message["content"] or ""})
    content.extend(_tool_use(c) for c in calls)
    reason, sequence = stop_reason(out, req.stop_sequences, bool(calls))
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(out.token_ids)}}


class _Blocks:
    """The content blocks of a streamed message: opens a block when the kind of delta
    changes (thinking, text, each tool call), closes the open one first."""

    def __init__(self):
        self.index, self.kind = -1, None

    def _open(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block})]

    def open_text(self) -> list[str]:
        """Events that open an (empty) text block, closing the open one."""
        return self._open("text", {"type": "text", "text": ""})

    def close(self) -> list[str]:
        """The ``content_block_stop`` of the open block, if one is open."""
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, delta: dict) -> list[str]:
        """Events for one chat delta (``reasoning_content`` / ``content`` / ``tool_calls``)."""
        events = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                events += self.open_text()
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:  # each call arrives whole (ToolCallStreamer)
            events += self._open("tool_use", {**_tool_use(call), "input": {}})
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": json.dumps(_tool_use(call)["input"])}))
        return events


async def _stream(iters, first, rid, model, view, stops) -> AsyncIterator[str]:
    blocks, output_tokens, started = _Blocks(), 0, False
    try:
        async for _, out in until_error(merge(iters)):
            if isinstance(out, BaseException):
                err = out if isinstance(out, APIError) else engine_error(out)
                yield event("error", error_body(err))
                return
            if not started:  # the first DELTA carries the prompt ids
                started = True
                yield event("message_start", {"type": "message_start", "message": {
                    "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": 0}}})
            failed = _failed(out)
            if failed is not None:
                yield event("error", error_body(failed))
                return
            output_tokens += len(out.token_ids)
            delta, _ = view.feed_delta(out)
            for e in blocks.feed(delta):
                yield e
            if out.finished:
                if blocks.index < 0:  # nothing was generated: one empty text block, as the whole reply
                    for e in blocks.open_text():
                        yield e
                for e in blocks.close():
                    yield e
                reason, sequence = stop_reason(out, stops, view.called)
                yield event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": {"output_tokens": output_tokens}})
                yield event("message_stop", {"type": "message_stop"})
    finally:
        await close_all(iters + [first])


async def count_tokens(ctx: ServerContext, req: CountTokensRequest) -> dict:
    """``{"input_tokens": N}``: the length of the prompt a Messages request with these
    fields would use (images' tokens included), without running it.

    Raises:
        APIError: 400 bad input (as ``create_message``), 404 unknown model, 503 shutting down.
    """
    chat = to_chat_request(req)
    ctx.check_model(chat.model)
    prompt = await _chat_prompt(ctx, req, chat)
    try:
        processed = (await ctx.engine.validate_prompts([prompt], SamplingParams(max_tokens=1)))[0]
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        raise engine_error(e) from e
    return {"input_tokens": len(processed.prompt_token_ids)}
