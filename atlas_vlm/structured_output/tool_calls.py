"""The constraint forcing Hermes / Qwen tool calls (``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``) for ``tool_choice="required"`` or a named function: a Lark grammar in
the structured-output backend's dialect whose calls name a given tool and whose arguments
follow that tool's ``parameters`` JSON schema. The parsers of the other formats
(``atlas_vlm.tool_parsers``) do not force calls."""

from __future__ import annotations

import json

from atlas_vlm.structured_output.params import StructuredOutputsParams

_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _call_schema(tool: dict, key: str = "arguments") -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def _forced_schema(tools: list[dict], tool_choice, parallel_tool_calls: bool, key: str) -> tuple[dict, bool]:
    """``(schema of one call, several calls allowed)`` for a forcing ``tool_choice``.

    Raises:
        ValueError: a named function that is not among ``tools``.
    """
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({[t['function']['name'] for t in tools]})")
        schema, many = _call_schema(chosen[0], key), False
    else:
        schemas = [_call_schema(t, key) for t in tools]
        schema, many = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), parallel_tool_calls
    return {**schema, "x-guidance": _JSON_STYLE}, many


def _params(lark: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(grammar=lark)
    except ValueError as e:
        raise ValueError(f"tools: a function's parameters schema is not supported: {e}") from None


def json_tool_call_structured_outputs(tools: list[dict], tool_choice, parallel_tool_calls: bool,
                                      style: str) -> StructuredOutputsParams | None:
    """The grammar forcing bare-JSON tool calls, or None (``tool_choice`` "none" / "auto").

    Args:
        tools, tool_choice, parallel_tool_calls: as ``tool_call_structured_outputs``.
        style: ``"llama3_json"``: ``{"name": N, "parameters": {...}}`` objects joined by
            ``"; "``; ``"mistral"``: a JSON list ``[{"name": N, "arguments": {...}}, ...]``.

    Raises:
        ValueError: an unknown ``style``; a named function that is not among ``tools``, or a
            parameters schema the grammar library refuses.
    """
    if tool_choice in (None, "none", "auto"):
        return None
    if style not in ("llama3_json", "mistral"):
        raise ValueError(f"style must be 'llama3_json' or 'mistral', got {style!r}")
    schema, many = _forced_schema(tools, tool_choice, parallel_tool_calls,
                                  "parameters" if style == "llama3_json" else "arguments")
    sep = '"; "' if style == "llama3_json" else '", "'
    calls = f"call ({sep} call)*" if many else "call"
    start = calls if style == "llama3_json" else f'"[" {calls} "]"'
    return _params(f"start: {start}\ncall: %json {json.dumps(schema)}\n")


def tool_call_structured_outputs(tools: list[dict], tool_choice, parallel_tool_calls: bool,
                                 marker_is_token: bool) -> StructuredOutputsParams | None:
    """The grammar forcing tool calls, or None (``tool_choice`` "none" / "auto").

    Args:
        tools: OpenAI tools ``[{"type": "function", "function": {"name", "parameters", ...}}]``.
        tool_choice: "none", "auto", "required", or ``{"type": "function", "function": {"name": N}}``.
        parallel_tool_calls: "required" may produce several calls (else exactly one); the
            model may end its turn after any complete call (EOS is allowed there).
        marker_is_token: ``<tool_call>`` is one token of the tokenizer (Qwen): the grammar
            names the token instead of spelling the text.

    Raises:
        ValueError: a named function that is not among ``tools``, or a parameters schema the
            grammar library refuses (the message names the function).
    """
    if tool_choice in (None, "none", "auto"):
        return None
    schema, many = _forced_schema(tools, tool_choice, parallel_tool_calls, "arguments")
    start, end = ("<tool_call>", "</tool_call>") if marker_is_token else ('"<tool_call>"', '"</tool_call>"')
    repeat = ' ("\\n" call)*' if many else ""
    # EOS (end of turn) is allowed after every complete call, and after one newline too
    # (where a model not trained on the format ends its line first); never inside a call
    return _params(f'start: call{repeat} "\\n"?\n'
                   f'call: {start} "\\n" body "\\n" {end}\n'
                   f"body: %json {json.dumps(schema)}\n")
