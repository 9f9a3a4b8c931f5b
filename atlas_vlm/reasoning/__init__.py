"""Reasoning ("thinking") parsers, as vLLM's ``vllm/reasoning``: which tokens open and close
the reasoning, whether a prompt already closed it, and the split of an output into
``reasoning_content`` and ``content`` (whole text and streamed)."""

from atlas_vlm.reasoning.qwen3 import Qwen3ReasoningParser, ReasoningParser, get_reasoning_parser

__all__ = ["Qwen3ReasoningParser", "ReasoningParser", "get_reasoning_parser"]
