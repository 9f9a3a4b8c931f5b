"""Llama 3.x JSON tool calls (vLLM's ``llama3_json`` parser, llama.cpp's Llama 3.x reader): the
reply is ``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too, and Llama 3.2's
leading ``"type": "function"``), optionally after ``<|python_tag|>``; several calls are
separated by ``;`` or whitespace. Without the tag, JSON objects of any name opening the reply
are calls (``<|python_tag|>`` is a special token, which the detokenizer drops; the forced calls
of ``tool_choice`` "required" / named are written without it); elsewhere a bare or fenced JSON
call must name one of the request's tools."""

from __future__ import annotations

from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager

TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """JSON call objects after ``<|python_tag|>``, opening the reply, or naming a requested tool."""

    tags = (TAG,)
    json_calls = True
    lenient_start = True
    separators = " \t\r\n;"
    arguments_keys = ("parameters", "arguments")
    forced_call_style = "llama3_json"  # forced calls: the objects without the tag
