"""Qwen3 / Qwen3-VL thinking: ``<think>`` ... ``</think>`` then the answer (registered as
``qwen3`` and ``deepseek_r1``, whose templates use the same markers).

The prompt tells where a request starts: Qwen3's template with
``chat_template_kwargs={"enable_thinking": False}`` ends the prompt with an empty
``<think>\\n\\n</think>\\n\\n`` (reasoning already over); templates that open the thinking
themselves end with ``<think>`` (reasoning under way); otherwise the model may open it with
its first token (or answer at once).
"""

from __future__ import annotations

from atlas_vlm.reasoning.abstract import ENDED, MAYBE, REASONING, ReasoningParser, ReasoningParserManager

__all__ = ["ENDED", "MAYBE", "REASONING", "Qwen3ReasoningParser"]


@ReasoningParserManager.register_module(["qwen3", "deepseek_r1"])
class Qwen3ReasoningParser(ReasoningParser):
    """``<think>`` / ``</think>`` of Qwen3 and Qwen3-VL (and DeepSeek-R1-style templates).

    Args:
        tokenizer: a tokenizer with ``<think>`` and ``</think>`` as single tokens.

    Raises:
        ValueError: the tokenizer lacks either marker as one token.
    """

    def __init__(self, tokenizer):
        ids = []
        for marker in ("<think>", "</think>"):
            tid = tokenizer.convert_tokens_to_ids(marker)
            if tid is None or tid == tokenizer.unk_token_id or tokenizer.encode(marker, add_special_tokens=False) != [tid]:
                raise ValueError(f"reasoning_parser 'qwen3' needs {marker!r} as one token of the tokenizer")
            ids.append(tid)
        super().__init__(ids[0], ids[1], "<think>", "</think>")
