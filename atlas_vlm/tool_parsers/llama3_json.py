"""Llama 3.x JSON tool calls (vLLM's ``llama3_json`` parser): the reply is
``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too), optionally after
``<|python_tag|>``; several calls are separated by ``;`` or whitespace. Without the tag the
reply must begin with ``{`` to be read as calls (``<|python_tag|>`` is a special token, which
the detokenizer drops: the ``{`` rule is what reads such a reply, and the forced calls of
``tool_choice`` "required" / named, which are written without the tag)."""

from __future__ import annotations

from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager, partial_suffix
from atlas_vlm.tool_parsers.json_calls import call_of, json_value, skip

TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """JSON call objects after ``<|python_tag|>`` or at the start of the reply."""

    start = TAG
    forced_call_style = "llama3_json"  # forced calls: the objects without the tag

    def find_start(self, text: str) -> int:
        k = text.find(TAG)
        if k != -1:
            return k
        first = skip(text, 0, " \t\r\n")
        return first if text[first:first + 1] == "{" else -1

    def held_back(self, text: str) -> int:
        if not text.strip():
            return len(text)  # a '{' may still come first
        return partial_suffix(text, TAG)

    def blocks(self, text: str, k: int) -> list[tuple[str, bool]]:
        pos = k + len(TAG) if text.startswith(TAG, k) else k
        out = []
        while True:
            pos = skip(text, pos, " \t\r\n;")
            if pos >= len(text):
                return out
            body, closed, pos = json_value(text, pos)
            out.append((body, closed))
            if not closed:
                return out

    def parse_block(self, body: str) -> tuple[str, str] | None:
        return call_of(body, ("parameters", "arguments"))
