"""Moved: the tool-call parsers live in ``atlas_vlm.tool_parsers`` (a registry of formats) and
the forced-call constraint in ``atlas_vlm.structured_output.tool_calls``. These names keep
the Hermes behaviour for code that imported them from here."""

from __future__ import annotations

from atlas_vlm.structured_output.tool_calls import tool_call_structured_outputs
from atlas_vlm.tool_parsers import ToolCallStreamer as _Streamer
from atlas_vlm.tool_parsers import new_tool_call_id
from atlas_vlm.tool_parsers.hermes import END, START, HermesToolParser

__all__ = ["END", "START", "ToolCallStreamer", "extract_tool_calls", "new_tool_call_id",
           "tool_call_structured_outputs"]


def extract_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a whole output in the Hermes format
    (``HermesToolParser().extract``)."""
    return HermesToolParser().extract(text)


class ToolCallStreamer(_Streamer):
    """The streamer of ``atlas_vlm.tool_parsers`` for the Hermes format."""

    def __init__(self, parser=None):
        super().__init__(parser or HermesToolParser())
