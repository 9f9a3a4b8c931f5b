"""Hermes / Qwen tool calls (vLLM's ``hermes`` tool parser, llama.cpp's Hermes 2 Pro reader):
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3, Qwen2.5-VL,
Qwen3-VL templates), and the forms the models also write under ``tool_choice="auto"``: the
same JSON object (or a list of them) bare or in a ```` ```json ```` fence, when it names one of
the request's tools (Qwen2.5-Coder's habit). ``tool_choice`` "required" / a named function force
``<tool_call>`` blocks (``atlas_vlm.structured_output.tool_calls``)."""

from __future__ import annotations

import re

from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager
from atlas_vlm.tool_parsers.json_calls import decode_calls

START, END = "<tool_call>", "</tool_call>"
_FENCED = re.compile(r"\s*```[\w+-]*\s*(.*?)\s*```\s*\Z", re.DOTALL)


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>`` blocks holding one JSON object each; bare or fenced JSON calls."""

    block_markers = {START: END}
    json_calls = True
    forced_call_style = "hermes"

    def parse_block(self, body: str) -> tuple[str, str] | None:
        fenced = _FENCED.match(body)  # a block some models fill with a fenced object
        pairs = decode_calls(fenced.group(1) if fenced else body, self.arguments_keys, None)
        return pairs[0] if pairs and len(pairs) == 1 else None
