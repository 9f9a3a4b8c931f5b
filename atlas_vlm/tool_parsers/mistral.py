"""Mistral tool calls (vLLM's ``mistral`` parser, pre-v11 tokenizers): ``[TOOL_CALLS]``
followed by a JSON list of ``{"name": ..., "arguments": {...}}``; the whole calls of a list cut
by ``max_tokens`` are kept. ``[TOOL_CALLS]`` is a special token of Mistral's tokenizers, which
the detokenizer drops: a reply that opens with a JSON list (or object) of calls is read as calls
too (so are the forced calls of ``tool_choice`` "required" / named, written as that bare list);
elsewhere a bare or fenced JSON call must name one of the request's tools."""

from __future__ import annotations

from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager

TAG = "[TOOL_CALLS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    """JSON lists of call objects after ``[TOOL_CALLS]`` (or opening the reply)."""

    tags = (TAG,)
    json_calls = True
    lenient_start = True
    forced_call_style = "mistral"  # forced calls: the list without the tag
