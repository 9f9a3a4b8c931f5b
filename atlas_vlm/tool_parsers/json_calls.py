"""What the JSON-object formats (Hermes' block bodies, Llama 3, Mistral) share: reading a call
object, and cutting a run of JSON values into blocks with ``json.JSONDecoder.raw_decode`` (a
value that decodes is closed; the rest of the text, when it does not decode, is one open
block: being written, cut, or not JSON)."""

from __future__ import annotations

import json

from atlas_vlm.tool_parsers.abstract import dump_arguments

_DECODER = json.JSONDecoder()


def skip(text: str, pos: int, chars: str) -> int:
    """The first index at or after ``pos`` whose character is not in ``chars``."""
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def json_value(text: str, pos: int) -> tuple[str, bool, int]:
    """``(text of the value at pos, closed, index after it)``: closed when a whole JSON value
    decodes there, else the rest of ``text`` as an open block."""
    try:
        _, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return text[pos:], False, len(text)
    return text[pos:end], True, end


def call_object(body: str) -> dict | None:
    """``body`` decoded as a call object (a JSON object with a string ``"name"``), or None."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None


def call_of(body: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a ``{"name": str, KEY: {...}}`` object for the
    first of ``keys`` present (a missing one: ``{}``), or None if ``body`` is not such a call."""
    obj = call_object(body)
    if obj is None:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    text = dump_arguments(args)
    return None if text is None else (obj["name"], text)
