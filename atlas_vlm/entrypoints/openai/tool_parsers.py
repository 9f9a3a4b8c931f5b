"""Tool calls in the Hermes / Qwen format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Qwen2.5, Qwen3, Qwen2.5-VL, Qwen3-VL templates; vLLM's ``hermes`` tool parser).

- ``tool_call_structured_outputs``: for ``tool_choice="required"`` or a named function, a
  Lark grammar (the structured-output backend's dialect) that forces one or more calls in this format whose ``name`` is a
  given tool and whose ``arguments`` follow that tool's ``parameters`` JSON schema;
- ``extract_tool_calls``: whole output -> ``(content, tool_calls)`` in OpenAI's shape;
- ``ToolCallStreamer``: the same split for a growing output as OpenAI ``tool_calls`` deltas
  (``index``, ``id``, ``type`` and ``name`` once, then ``arguments`` fragments whose
  concatenation is the call's ``arguments`` string).
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
        parallel_tool_calls: "required" may produce several calls (else exactly one).
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
    lark = (f"start: call{repeat}\n"
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
    ``<tool_call>`` (None if empty); if any block does not parse as a call, there are no
    calls and the whole text is content (as vLLM's hermes parser)."""
    k = text.find(START)
    if k == -1:
        return text, []
    calls = []
    for body, _closed in _blocks(text):
        split = _split_call(body.strip())
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
    """Turns a growing output into content deltas and OpenAI ``tool_calls`` deltas."""

    def __init__(self):
        self.content_sent = 0
        self.calls: list[dict] = []  # per call: id, name (once sent), args_sent

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """``(content delta, tool_call deltas)`` for the output ``text`` so far."""
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
            if i == len(self.calls):
                self.calls.append({"id": new_tool_call_id(), "name": None, "args_sent": ""})
            call = self.calls[i]
            if closed or finished:
                split = _split_call(body.strip())
                if split is None:
                    continue
                name, args = split
            else:
                m = _HEADER.match(body)
                if not m:
                    continue
                name = json.loads(f'"{m.group(1)}"')
                args = body[m.end():]
                args = args[:len(args) - _partial_suffix(args, END)].rstrip().rstrip("}").rstrip()
                # the last '}' closes the call object; the ones before it may close the arguments:
                # hold back every trailing '}' until the block closes
            if call["name"] is None:
                call["name"] = name
                deltas.append({"index": i, "id": call["id"], "type": "function",
                               "function": {"name": name, "arguments": ""}})
            if args.startswith(call["args_sent"]) and len(args) > len(call["args_sent"]):
                deltas.append({"index": i, "function": {"arguments": args[len(call["args_sent"]):]}})
                call["args_sent"] = args
        return content, deltas
