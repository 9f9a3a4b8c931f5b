"""Qwen3 / Qwen3-VL thinking: ``<think>`` ... ``</think>`` then the answer.

The prompt tells where a request starts: Qwen3's template with
``chat_template_kwargs={"enable_thinking": False}`` ends the prompt with an empty
``<think>\\n\\n</think>\\n\\n`` (reasoning already over); templates that open the thinking
themselves end with ``<think>`` (reasoning under way); otherwise the model may open it with
its first token (or answer at once).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Where a request's output is with respect to its reasoning.
MAYBE, REASONING, ENDED = "maybe", "reasoning", "ended"


@dataclass
class ReasoningParser:
    """Token ids and text markers of one reasoning format.

    Args:
        start_token_id, end_token_id: ids of the start and end markers (single tokens).
        start, end: their text.
    """

    start_token_id: int
    end_token_id: int
    start: str
    end: str

    def initial_state(self, prompt_token_ids: list[int]) -> str:
        """``ENDED`` if the prompt's last marker is the end one, ``REASONING`` if it is the
        start one, else ``MAYBE`` (the first output token decides)."""
        for t in reversed(prompt_token_ids):
            if t == self.end_token_id:
                return ENDED
            if t == self.start_token_id:
                return REASONING
        return MAYBE

    def extract_reasoning(self, text: str) -> tuple[str | None, str]:
        """``(reasoning_content or None, content)`` of a whole output (special tokens
        already skipped by the detokenizer, the markers kept as they are not special).

        An output that does not open with the start marker is all content; an unclosed
        reasoning (``max_tokens`` hit while thinking) is all reasoning.
        """
        stripped = text.lstrip()
        if not stripped.startswith(self.start):
            if self.end in text:  # the prompt opened it (template ending in the start marker)
                reasoning, _, content = text.partition(self.end)
                return reasoning, content.lstrip("\n")
            return None, text
        body = stripped[len(self.start):]
        if self.end not in body:
            return body, ""
        reasoning, _, content = body.partition(self.end)
        return reasoning, content.lstrip("\n")

    def extract_reasoning_streaming(self, text: str, finished: bool) -> tuple[str, str]:
        """``(reasoning so far, content so far)`` of a growing output, never showing text a
        later token could move to the other side: a suffix that could still grow into a
        marker, and the newlines right after the end marker, are held back until the end."""
        if not finished:
            for marker in (self.start, self.end):
                for k in range(min(len(marker) - 1, len(text)), 0, -1):
                    if text.endswith(marker[:k]):
                        text = text[:-k]
                        break
        stripped = text.lstrip()
        if not stripped and not finished:
            return "", ""
        if not stripped.startswith(self.start) and self.end not in text:
            if not finished and self.start.startswith(stripped):
                return "", ""
            return "", text
        reasoning, content = self.extract_reasoning(text)
        if not finished and not content.strip("\n"):
            content = ""
        return reasoning or "", content


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


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": Qwen3ReasoningParser}


def get_reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser called ``name`` for ``tokenizer`` (None: no reasoning).

    Raises:
        ValueError: an unknown name (the known ones listed), or a tokenizer without its markers.
    """
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {name!r} is not known; known: {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](tokenizer)
