"""Qwen3-Coder XML tool calls (vLLM's ``qwen3_coder`` parser)::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is text; it is typed by the tool's parameter schema as vLLM does (string kept,
integer / number / boolean converted, object / array / anything else read as JSON when it
parses, ``null`` -> None); a parameter the schema does not know stays a string.
"""

from __future__ import annotations

import json
import re

from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def _convert(value: str, schema: dict | None):
    """``value`` typed by the parameter's JSON schema (None: unknown parameter, a string)."""
    if schema is None:
        return value
    if value.lower() == "null":
        return None
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    kind = kind.lower() if isinstance(kind, str) else None
    if kind in _STRING_TYPES:
        return value
    if kind in ("integer", "int"):
        try:
            return int(value)
        except ValueError:
            return value
    if kind in ("number", "float"):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    if kind in ("boolean", "bool"):
        return value.lower() == "true" if value.lower() in ("true", "false") else value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """``<tool_call>`` blocks holding one ``<function=NAME>`` with ``<parameter=P>`` values."""

    block_markers = {START: END}

    def _properties(self, name: str) -> dict:
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == name:
                return (fn.get("parameters") or {}).get("properties") or {}
        return {}

    def parse_block(self, body: str) -> tuple[str, str] | None:
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = self._properties(name)
        args = {}
        for p in _PARAMETER.finditer(m.group(2)):
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = p.group(1).strip()
            args[key] = _convert(value, props.get(key))
        return name, json.dumps(args, ensure_ascii=False)
