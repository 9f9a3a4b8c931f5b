"""Reasoning ("thinking") parsers behind a registry, as vLLM's ``vllm/reasoning`` and the tool
parsers (``atlas_vlm.tool_parsers``): ``qwen3`` and ``deepseek_r1`` (``<think>`` ..
``</think>``). Chosen by ``--reasoning-parser`` / ``LLM(reasoning_parser=...)``; the choices
are ``ReasoningParserManager.names()``. A parser tells which tokens open and close the
reasoning and whether a prompt already closed it; ``ReasoningStreamer`` splits an output into
``reasoning_content`` and ``content``, whole or streamed (one scan, reading only new text)."""

from atlas_vlm.reasoning import qwen3  # noqa: F401  (register)
from atlas_vlm.reasoning.abstract import (ENDED, MAYBE, REASONING, ReasoningParser, ReasoningParserManager,
                                          get_reasoning_parser)
from atlas_vlm.reasoning.qwen3 import Qwen3ReasoningParser
from atlas_vlm.reasoning.streaming import ReasoningStreamer

__all__ = ["ENDED", "MAYBE", "REASONING", "Qwen3ReasoningParser", "ReasoningParser", "ReasoningParserManager",
           "ReasoningStreamer", "get_reasoning_parser"]
