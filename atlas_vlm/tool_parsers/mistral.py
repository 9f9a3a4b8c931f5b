"""Mistral tool calls (vLLM's ``mistral`` parser, pre-v11 tokenizers): ``[TOOL_CALLS]``
followed by a JSON list of ``{"name": ..., "arguments": {...}}``. Each list item is one
block, so the complete calls of a list cut by ``max_tokens`` are kept. ``[TOOL_CALLS]`` is
a special token of Mistral's tokenizers, which the detokenizer drops: a reply that begins
with a JSON list (``[`` then ``{``) is read as calls too (so are the forced calls of
``tool_choice`` "required" / named, written as that bare list)."""

from __future__ import annotations

import re

from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager
from atlas_vlm.tool_parsers.json_calls import call_of, json_value, skip

TAG = "[TOOL_CALLS]"
_SPACE = " \t\r\n"
_BARE_LIST = re.compile(r"\s*\[\s*\{")


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    """JSON lists of call objects after ``[TOOL_CALLS]`` (or opening the reply)."""

    start = TAG
    forced_call_style = "mistral"  # forced calls: the list without the tag

    def find_start(self, text: str) -> int:
        k = text.find(TAG)
        if k != -1:
            return k
        return skip(text, 0, _SPACE) if _BARE_LIST.match(text) else -1

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or (stripped.startswith("[") and not stripped[1:].strip()):
            return len(text)  # may still become a bare list of calls
        return super().held_back(text)

    def blocks(self, text: str, k: int) -> list[tuple[str, bool]]:
        out = []
        pos = k
        while pos != -1:
            pos = skip(text, pos + len(TAG) if text.startswith(TAG, pos) else pos, _SPACE)
            if text.startswith("[", pos):
                pos += 1
            while True:  # the list's items
                pos = skip(text, pos, _SPACE + ",")
                if pos >= len(text):
                    return out
                if text[pos] == "]":
                    break
                body, closed, pos = json_value(text, pos)
                out.append((body, closed))
                if not closed:
                    return out
            pos = text.find(TAG, pos)
        return out

    def parse_block(self, body: str) -> tuple[str, str] | None:
        return call_of(body, ("arguments", "parameters"))
