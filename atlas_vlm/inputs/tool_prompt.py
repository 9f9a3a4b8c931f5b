"""The fallback tools prompt: for a chat template that does not render ``tools`` (SmolLM2's,
the Qwen2.5-VL one the VLM path falls back to), the tools go into the system message as
Qwen2.5's template writes them (Hermes style: ``<tools>`` JSON lines, calls asked for as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), so the model sees them
and the tool parser reads its calls (vLLM renders ``tools`` only through the template; a
template that drops them would leave the model blind to them, which nobody asking for tools
wants). Whether a template renders tools is seen by rendering with and without them."""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)

_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_OUTRO = ("</tools>\n\nFor each function call, return a json object with function name and arguments within "
          "<tool_call></tool_call> XML tags:\n<tool_call>\n"
          '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tools_system_text(tools: list[dict]) -> str:
    """The ``# Tools`` block of Qwen2.5-Instruct's chat template for ``tools`` (OpenAI tool
    definitions, one JSON line each, as the template's ``tool | tojson``)."""
    lines = [json.dumps(tool, ensure_ascii=False) for tool in tools]
    return "\n".join([_INTRO, *lines, _OUTRO])


def with_tools_system_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the tools block appended to the first message's content if it is a
    system message (after a blank line; a content list gets a text item), else in a new
    system message put first. The input is not modified."""
    block = tools_system_text(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": "\n\n" + block}]
        else:
            first["content"] = f"{content}\n\n{block}" if content else block
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def render_with_tools(render, p: dict) -> list[int]:
    """Prompt ids of the parsed chat prompt ``p`` by ``render(p)``; where ``p`` has tools
    and the template renders nothing of them (the same ids without), the tools go into the
    system message instead (``with_tools_system_prompt``) and a warning is logged (once per
    process), so tools are never dropped silently.

    Args:
        render: ``parsed chat prompt dict -> list[int]`` (the family's template path).
        p: a chat prompt dict after ``parse_chat_prompt``.
    """
    ids = render(p)
    if not p["tools"]:
        return ids
    plain = {**p, "tools": None}
    if ids != render(plain):
        return ids
    global _warned
    if not _warned:
        _warned = True
        logger.warning("the chat template does not render tools: they go into the system message in the Hermes "
                       "<tool_call> format instead (docs/structured-output.md, 'Tool calls')")
    return render({**plain, "messages": with_tools_system_prompt(p["messages"], p["tools"])})


_warned = False
