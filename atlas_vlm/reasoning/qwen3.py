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

    def extract_reasoning(self, text: str, state: str = MAYBE) -> tuple[str | None, str]:
        """``(reasoning_content or None, content)`` of a whole output (special tokens
        already skipped by the detokenizer; the markers are plain added tokens and stay).

        Args:
            state: ``initial_state`` of the request's prompt: ``ENDED`` (thinking off) means
                all content; ``REASONING`` means the output starts inside the reasoning;
                ``MAYBE``: reasoning only if the output opens with the start marker.

        An unclosed reasoning (``max_tokens`` hit while thinking) is all reasoning; the
        newlines after the end marker are dropped from the content.
        """
        if state == ENDED:
            return None, text
        if state == MAYBE:
            stripped = text.lstrip()
            if not stripped.startswith(self.start):
                return None, text
            text = stripped[len(self.start):]
        if self.end not in text:
            return text, ""
        reasoning, _, content = text.partition(self.end)
        return reasoning, content.lstrip("\n")

    def extract_reasoning_streaming(self, text: str, finished: bool, state: str = MAYBE) -> tuple[str, str]:
        """``(reasoning so far, content so far)`` of a growing output; each only grows from
        call to call. Text a later token could move to the other side is held back until it
        cannot (a suffix that could grow into a marker, an output that could still open
        with the start marker, the newlines right after the end marker)."""
        if state == ENDED:
            return "", text
        if not finished:
            for marker in (self.start, self.end):
                k = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)
                if k:
                    text = text[:-k]
                    break
        if state == MAYBE:
            stripped = text.lstrip()
            if not finished and (not stripped or self.start.startswith(stripped)):
                return "", ""
            if not stripped.startswith(self.start):
                return "", text
        reasoning, content = self.extract_reasoning(text, state)
        if not finished and not content:
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
