"""Tool calls in the Hermes / Qwen format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Qwen2.5, Qwen3, Qwen2.5-VL, Qwen3-VL templates; vLLM's ``hermes`` tool parser).

- ``tool_call_structured_outputs``: for ``tool_choice="required"`` or a named function, a
  Lark grammar (the structured-output backend's dialect) that forces one or more calls in this format whose ``name`` is a
  given tool and whose ``arguments`` follow that tool's ``parameters`` JSON schema;
- ``extract_tool_calls``: whole output -> ``(content, tool_calls)`` in OpenAI's shape;
- ``ToolCallStreamer``: the same split for a growing output as OpenAI ``tool_calls`` deltas,
  one whole call per delta once it is complete (a call cut by ``max_tokens`` is dropped by
  both, so streamed and whole outputs give the same calls).
"""

from __future__ import annotations

import json
import re
import uuid

from atlas_vlm.structured_output import StructuredOutputsParams

START, END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_structured_outputs(tools: list[dict], tool_choice, parallel_tool_calls: bool,
                                 marker_is_token: bool) -> StructuredOutputsParams | None:
    """The grammar forcing tool calls, or None (``tool_choice`` "none" / "auto").

    Args:
        tools: OpenAI tools ``[{"type": "function", "function": {"name", "parameters", ...}}]``.
        tool_choice: "none", "auto", "required", or ``{"type": "function", "function": {"name": N}}``.
        parallel_tool_calls: "required" may produce several calls (else exactly one); the
            model may end its turn after any complete call (EOS is allowed there).
        marker_is_token: ``<tool_call>`` is one token of the tokenizer (Qwen): the grammar
            names the token instead of spelling the text.

    Raises:
        ValueError: a named function that is not among ``tools``, or a parameters schema the
            grammar library refuses (the message names the function).
    """
    if tool_choice in (None, "none", "auto"):
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({[t['function']['name'] for t in tools]})")
        schema, many = _call_schema(chosen[0]), False
    else:
        schemas = [_call_schema(t) for t in tools]
        schema, many = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), parallel_tool_calls
    schema = {**schema, "x-guidance": _JSON_STYLE}
    start, end = ("<tool_call>", "</tool_call>") if marker_is_token else ('"<tool_call>"', '"</tool_call>"')
    repeat = ' ("\\n" call)*' if many else ""
    # EOS (end of turn) is allowed after every complete call, and after one newline too
    # (where a model not trained on the format ends its line first); never inside a call
    lark = (f'start: call{repeat} "\\n"?\n'
            f'call: {start} "\\n" body "\\n" {end}\n'
            f"body: %json {json.dumps(schema)}\n")
    try:
        return StructuredOutputsParams(grammar=lark)
    except ValueError as e:
        raise ValueError(f"tools: a function's parameters schema is not supported: {e}") from None


def _split_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments string)`` of one call's JSON text, or None if it is not a call.
    The arguments string is the model's own text of the value when it is the last key (so a
    stream of fragments adds up to it), else ``json.dumps`` of the value."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    m = _HEADER.match(body)
    if m:
        rest = body[m.end():].rstrip()
        if rest.endswith("}"):
            raw = rest[:-1].rstrip()
            try:
                if json.loads(raw) == args:
                    return obj["name"], raw
            except json.JSONDecodeError:
                pass
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _blocks(text: str) -> list[tuple[str, bool]]:
    """``(body, closed)`` of every ``<tool_call>`` block of ``text``, in order."""
    out = []
    pos = text.find(START)
    while pos != -1:
        body_start = pos + len(START)
        end = text.find(END, body_start)
        if end == -1:
            out.append((text[body_start:], False))
            break
        out.append((text[body_start:end], True))
        pos = text.find(START, end + len(END))
    return out


def extract_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a whole output: content is the text before the first
    ``<tool_call>`` (None if empty). A last block left open that does not parse was cut
    (``max_tokens``, a stop string) and is dropped, the complete calls before it kept (the
    same calls ``ToolCallStreamer`` streams); if a closed block does not parse, there are
    no calls and the whole text is content (as vLLM's hermes parser)."""
    k = text.find(START)
    if k == -1:
        return text, []
    calls = []
    blocks = _blocks(text)
    for n, (body, closed) in enumerate(blocks):
        split = _split_call(body.strip())
        if split is None and not closed and n == len(blocks) - 1:
            break
        if split is None:
            return text, []
        calls.append({"id": new_tool_call_id(), "type": "function",
                      "function": {"name": split[0], "arguments": split[1]}})
    content = text[:k]
    return (content if content.strip() else None), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStreamer:
    """Turns a growing output into content deltas and OpenAI ``tool_calls`` deltas.

    A call is sent whole (``index``, ``id``, ``type``, ``function.name`` and
    ``function.arguments`` in one delta) once its ``</tool_call>`` arrives, or at the end
    if the open block parses: a call cut by ``max_tokens`` is never sent, so the streamed
    calls are exactly those ``extract_tool_calls`` finds in the whole output."""

    def __init__(self):
        self.content_sent = 0
        self.blocks_done = 0  # <tool_call> blocks sent or dropped
        self.calls: list[dict] = []  # per sent call: id, name

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """``(content delta, tool_call deltas)`` for the output ``text`` so far (``finished``:
        it is the whole output)."""
        k = text.find(START)
        content_end = len(text) if k == -1 else k
        if k == -1 and not finished:
            content_end -= _partial_suffix(text, START)
        content = text[self.content_sent:content_end] if content_end > self.content_sent else ""
        self.content_sent = max(self.content_sent, content_end)
        deltas: list[dict] = []
        if k == -1:
            return content, deltas
        for i, (body, closed) in enumerate(_blocks(text)):
            if i < self.blocks_done:
                continue
            if not closed and not finished:
                break
            self.blocks_done = i + 1
            split = _split_call(body.strip())
            if split is None:
                continue
            call = {"id": new_tool_call_id(), "name": split[0]}
            deltas.append({"index": len(self.calls), "id": call["id"], "type": "function",
                           "function": {"name": split[0], "arguments": split[1]}})
            self.calls.append(call)
        return content, deltas
