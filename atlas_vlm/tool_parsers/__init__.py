"""Tool-call formats behind a registry, as vLLM's ``ToolParserManager``: ``hermes``
(Hermes / Qwen ``<tool_call>`` JSON), ``qwen3_coder`` (Qwen3-Coder XML), ``llama3_json``
(Llama 3 JSON) and ``mistral`` (``[TOOL_CALLS]`` JSON list). Chosen by ``--tool-call-parser``
/ ``LLM(tool_call_parser=...)``, else from the chat template's text (``detect_tool_parser``)."""

from __future__ import annotations

from atlas_vlm.tool_parsers import hermes, llama3_json, mistral, qwen3_coder  # noqa: F401  (register)
from atlas_vlm.tool_parsers.abstract import ToolParser, ToolParserManager
from atlas_vlm.tool_parsers.streaming import ToolCallStreamer, new_tool_call_id

__all__ = ["ToolCallStreamer", "ToolParser", "ToolParserManager", "detect_tool_parser", "forced_tool_calls",
           "new_tool_call_id", "resolve_tool_parser"]


def _template_text(chat_template) -> str:
    """One string of a chat template given as a str, a ``{name: template}`` dict or a list of
    ``{"name", "template"}`` (transformers' forms)."""
    if isinstance(chat_template, dict):
        return "\n".join(str(t) for t in chat_template.values())
    if isinstance(chat_template, list):
        return "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in chat_template)
    return chat_template or ""


def detect_tool_parser(chat_template) -> str:
    """The tool parser a chat template's text points to: ``<function=`` -> ``qwen3_coder``,
    ``[TOOL_CALLS]`` -> ``mistral``, ``<|python_tag|>`` or Llama 3's ``ipython`` role ->
    ``llama3_json``, else (``<tool_call>``, no template, anything else) ``hermes``."""
    text = _template_text(chat_template)
    if "<function=" in text:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("ipython" in text and "<|start_header_id|>" in text):
        return "llama3_json"
    return "hermes"


def resolve_tool_parser(name: str | None, chat_template=None) -> type[ToolParser]:
    """The parser class named ``name`` (``--tool-call-parser``), or when None the one the
    chat template points to (``detect_tool_parser``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    return ToolParserManager.get_tool_parser(name if name is not None else detect_tool_parser(chat_template))


def forced_tool_calls(parser_cls: type[ToolParser], tools: list[dict], tool_choice, parallel_tool_calls: bool,
                      tokenizer):
    """The ``StructuredOutputsParams`` forcing calls for ``tool_choice`` "required" or a named
    function, or None ("none", "auto", None).

    Args:
        parser_cls: the request's tool parser; one with a ``forced_call_style`` (``hermes``,
            ``llama3_json``, ``mistral``; not ``qwen3_coder``) can force calls.
        tools: OpenAI tool definitions.
        tool_choice: "none", "auto", "required" or ``{"type": "function", "function": {"name": N}}``.
        parallel_tool_calls: "required" may produce several calls.
        tokenizer: the model's tokenizer (whether ``<tool_call>`` is one token).

    Raises:
        ValueError: a named function not in ``tools``; a schema the constraint refuses; a
            parser that cannot force calls (the message names the parsers that can).
    """
    if tool_choice in (None, "none", "auto"):
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools ({known})")
    style = parser_cls.forced_call_style
    if style is None:
        able = [n for n in ToolParserManager.names() if ToolParserManager.tool_parsers[n].forced_call_style]
        what = "'required'" if tool_choice == "required" else "a named function"
        raise ValueError(f"tool_choice {what} is supported by the {', '.join(able)} tool parsers only; this "
                         f"model uses {parser_cls.name!r} (--tool-call-parser / tool_call_parser); use tool_choice "
                         "'auto' or 'none'")
    from atlas_vlm.structured_output.tool_calls import json_tool_call_structured_outputs, tool_call_structured_outputs

    if style != "hermes":
        return json_tool_call_structured_outputs(tools, tool_choice, parallel_tool_calls, style)
    marker = tokenizer.convert_tokens_to_ids(hermes.START)
    marker_is_token = tokenizer.encode(hermes.START, add_special_tokens=False) == [marker]
    return tool_call_structured_outputs(tools, tool_choice, parallel_tool_calls, marker_is_token)
