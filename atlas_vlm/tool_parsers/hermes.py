"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Qwen2.5, Qwen3, Qwen2.5-VL, Qwen3-VL templates; vLLM's ``hermes`` tool parser); ``tool_choice``
"required" / a named function force these blocks (``atlas_vlm.structured_output.tool_calls``)."""

from __future__ import annotations

import json
import re

from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager, marker_blocks
from atlas_vlm.tool_parsers.json_calls import call_object

START, END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def split_json_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments string)`` of one call's JSON text (``{"name", "arguments"}``, or
    ``"parameters"`` as Llama writes it), or None if it is not a call. The arguments string
    is the model's own text of the value when it is the last key (so a stream of fragments
    adds up to it), else ``json.dumps`` of the value."""
    obj = call_object(body)
    if obj is None:
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


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>`` blocks holding one JSON object each."""

    start = START
    forced_call_style = "hermes"

    def blocks(self, text: str, k: int) -> list[tuple[str, bool]]:
        return marker_blocks(text, k, START, END)

    def parse_block(self, body: str) -> tuple[str, str] | None:
        return split_json_call(body.strip())
