"""The Responses API's output shapes (OpenAI's API reference for the ``response`` object):
output items (``message`` with ``output_text``, ``function_call``, ``reasoning``), ``usage``,
``status`` / ``incomplete_details`` from the engine's finish reason, and the response object."""

from __future__ import annotations

import time
import uuid

from atlas_vlm.entrypoints.openai.protocol import printable
from atlas_vlm.entrypoints.openai.responses.protocol import ResponsesRequest


def item_id(prefix: str) -> str:
    """An OpenAI-style id: ``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text: str | None, status: str = "completed") -> dict:
    """An assistant ``message`` item; ``text`` None: no content part yet (a stream's start)."""
    content = [] if text is None else [text_part(text)]
    return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(fid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    """A ``function_call`` item: the client runs ``name(**json.loads(arguments))`` and sends
    back a ``function_call_output`` item with the same ``call_id``."""
    return {"id": fid, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(rid: str, text: str) -> dict:
    """The model's thinking (a reasoning parser split it from the answer)."""
    return {"id": rid, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def output_items(message: dict) -> list[dict]:
    """Output items of a finished chat ``message`` (``ChatChoiceOutput.message``): reasoning
    first, then the text (always, unless the answer is only tool calls), then the calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(item_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(item_id("msg"), message.get("content") or ""))
    for c in calls:
        items.append(function_call_item(item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"]))
    return items


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Responses ``usage`` (token counts; ``cached_tokens``: prompt tokens from the prefix cache)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def finish_status(finish_reason: str | None, error: str | None = None) -> dict:
    """``status``, ``incomplete_details`` and ``error`` for the engine's finish reason:
    stop -> completed, length -> incomplete (``max_output_tokens``), abort -> cancelled,
    error -> failed (the request's own error message)."""
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "error": None}
    if finish_reason == "abort":
        return {"status": "cancelled", "incomplete_details": None, "error": None}
    if finish_reason == "error":
        return {"status": "failed", "incomplete_details": None,
                "error": {"code": "server_error", "message": printable(error or "the request failed")}}
    return {"status": "completed", "incomplete_details": None, "error": None}


def response_object(rid: str, model: str, req: ResponsesRequest, status: str = "in_progress") -> dict:
    """The ``response`` object before its output: echoes the request's settings (as OpenAI
    does); ``output`` empty, ``usage`` None, ``status`` as given."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    choice = req.tool_choice
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": [], "usage": None, "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "store": req.store, "text": {"format": fmt or {"type": "text"}}, "metadata": req.metadata or {},
            "user": req.user, "background": req.background}
