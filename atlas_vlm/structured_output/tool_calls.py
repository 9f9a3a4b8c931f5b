"""The constraint forcing Hermes / Qwen tool calls (``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``) for ``tool_choice="required"`` or a named function: a Lark grammar in
the structured-output backend's dialect whose calls name a given tool and whose arguments
follow that tool's ``parameters`` JSON schema. The parsers of the other formats
(``atlas_vlm.tool_parsers``) do not force calls."""

from __future__ import annotations

import json

from atlas_vlm.structured_output.params import StructuredOutputsParams

_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


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
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({[t['function']['name'] for t in tools]})")
        schema, many = _call_schema(chosen[0]), False
    else:
        schemas = [_call_schema(t) for t in tools]
        schema, many = (schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), parallel_tool_calls
    schema = {**schema, "x-guidance": _JSON_STYLE}
    start, end = ("<tool_call>", "</tool_call>") if marker_is_token else ('"<tool_call>"', '"</tool_call>"')
    repeat = ' ("\\n" call)*' if many else ""
    # EOS (end of turn) is allowed after every complete call, and after one newline too
    # (where a model not trained on the format ends its line first); never inside a call
    lark = (f'start: call{repeat} "\\n"?\n'
            f'call: {start} "\\n" body "\\n" {end}\n'
            f"body: %json {json.dumps(schema)}\n")
    try:
        return StructuredOutputsParams(grammar=lark)
    except ValueError as e:
        raise ValueError(f"tools: a function's parameters schema is not supported: {e}") from None
