"""JSON tool calls as models write them, for the JSON formats (Hermes / Qwen, Llama 3, Mistral):
the incremental scan that finds where a JSON value written in a growing text ends, and the
reading of a decoded value as calls.

A value is a *call* when it is an object with a string ``"name"``, its arguments under
``"arguments"`` or ``"parameters"`` (an object, or the JSON text of one as a string); a list of
such objects is several calls. Outside the formats' own markers a call must name one of the
request's tools and carry an arguments key (llama.cpp's rule for bare and fenced JSON calls):
``{"name": "x"}`` in prose, or JSON about something else, stays content.
"""

from __future__ import annotations

import json
import re

_DECODER = json.JSONDecoder()
_STRUCTURAL = re.compile(r'[{}\[\]"]')
_IN_STRING = re.compile(r'["\\]')
_CLOSERS = {"}": "{", "]": "["}


def dump_arguments(args) -> str | None:
    """The OpenAI ``arguments`` string of a parsed arguments value: a dict as JSON text, a
    string as given (some models write the JSON as a string); None for anything else."""
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    return None


class JsonSpan:
    """Where the JSON object or array opening at ``start`` ends, read incrementally: each
    ``feed`` looks only at the text added since the last one.

    Args:
        start: index of the value's ``{`` or ``[`` in the text.
    """

    def __init__(self, start: int):
        self.start = start
        self.scanned = start  # the text before this index is read
        self.stack: list[str] = []
        self.in_string = False
        self.end = -1  # index after the closing bracket, once found

    def feed(self, text: str) -> str:
        """``"closed"`` (``self.end`` is set), ``"open"`` (the text ends inside the value) or
        ``"broken"`` (a closing bracket that does not match: not JSON)."""
        if self.end != -1:
            return "closed"
        pos = self.scanned
        while pos < len(text):
            if self.in_string:
                m = _IN_STRING.search(text, pos)
                if m is None:
                    pos = len(text)
                    break
                if m.group() == "\\":
                    if m.end() >= len(text):  # the escaped character is still to come
                        pos = m.start()
                        break
                    pos = m.end() + 1
                    continue
                self.in_string, pos = False, m.end()
                continue
            m = _STRUCTURAL.search(text, pos)
            if m is None:
                pos = len(text)
                break
            c, pos = m.group(), m.end()
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.stack.append(c)
            elif not self.stack or self.stack.pop() != _CLOSERS[c]:
                self.scanned = pos
                return "broken"
            elif not self.stack:
                self.scanned = self.end = pos
                return "closed"
        self.scanned = pos
        return "open"


def call_pair(obj, keys: tuple[str, ...], tool_names: set[str] | None) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of one decoded call object, or None if it is not a call.

    Args:
        keys: the arguments keys in the order looked for (a missing one: ``{}``).
        tool_names: None: any name, the arguments key optional (inside a format's markers);
            else the name must be one of these and an arguments key present.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    present = [k for k in keys if k in obj]
    if tool_names is not None and (obj["name"] not in tool_names or not present):
        return None
    text = dump_arguments(obj[present[0]] if present else {})
    return None if text is None else (obj["name"], text)


def calls_in(value, keys: tuple[str, ...], tool_names: set[str] | None) -> list[tuple[str, str]] | None:
    """The calls of a decoded JSON value (an object, or a non-empty list of them, every item a
    call), or None if it is not calls; ``keys`` and ``tool_names`` as in :func:`call_pair`."""
    items = value if isinstance(value, list) and value else [value]
    pairs = [call_pair(v, keys, tool_names) for v in items]
    return None if any(p is None for p in pairs) else pairs


def decode_calls(text: str, keys: tuple[str, ...], tool_names: set[str] | None) -> list[tuple[str, str]] | None:
    """The calls of a JSON text (surrounding whitespace allowed), or None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return calls_in(value, keys, tool_names)


def complete_items(text: str, start: int, keys: tuple[str, ...],
                   tool_names: set[str] | None) -> list[tuple[str, str]]:
    """The calls among the complete leading items of a JSON list cut short (``text[start]`` is
    its ``[``): Mistral's rule, a list cut by ``max_tokens`` keeps its whole calls."""
    out, pos = [], start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out
        pair = call_pair(value, keys, tool_names)
        if pair is None:
            return out
        out.append(pair)
