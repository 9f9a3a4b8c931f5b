"""The reasoning-parser interface and its registry (as vLLM's ``ReasoningParser`` and
``ReasoningParserManager``, ``vllm/reasoning/abs_reasoning_parsers.py``).

A parser states its format: the token ids and texts of the start and end markers. One
incremental scan (``atlas_vlm.reasoning.streaming.ReasoningStreamer``) reads an output with
it, whole (``extract_reasoning``) or streamed, with the same result. The prompt tells where a
request starts (``initial_state``): ``ENDED`` (the prompt closed the reasoning, e.g. Qwen3's
``enable_thinking=False``), ``REASONING`` (the prompt opened it) or ``MAYBE`` (the output
may open it with its first token, or answer at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atlas_vlm.reasoning.streaming import ENDED, MAYBE, REASONING, ReasoningStreamer

__all__ = ["ENDED", "MAYBE", "REASONING", "ReasoningParser", "ReasoningParserManager", "get_reasoning_parser"]


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

    def streamer(self, state: str = MAYBE) -> ReasoningStreamer:
        """A ``ReasoningStreamer`` for one output starting in ``state`` (``initial_state``).

        Raises:
            ValueError: ``state`` is not one of the three states.
        """
        return ReasoningStreamer(self, state)

    def extract_reasoning(self, text: str, state: str = MAYBE) -> tuple[str | None, str]:
        """``(reasoning_content or None, content)`` of a whole output (special tokens
        already skipped by the detokenizer; the markers are plain added tokens and stay).

        Args:
            state: ``initial_state`` of the request's prompt: ``ENDED`` (thinking off) means
                all content; ``REASONING`` means the output starts inside the reasoning;
                ``MAYBE``: reasoning only if the output opens (after blanks) with the start marker.

        An unclosed reasoning (``max_tokens`` hit while thinking) is all reasoning; the
        newlines after the end marker are dropped from the content. The same scan as streaming.
        """
        s = self.streamer(state)
        reasoning, content = s.feed(text, True)
        return (reasoning if s.opened else None), content


class ReasoningParserManager:
    """The registry of reasoning parsers by name (vLLM's ``--reasoning-parser`` names)."""

    reasoning_parsers: dict[str, Callable] = {}

    @classmethod
    def register_module(cls, name: str | list[str]) -> Callable:
        """Class decorator registering a parser class (built from a tokenizer) under ``name``
        (or several names).

        Raises:
            ValueError: a name already registered to another class.
        """
        names = [name] if isinstance(name, str) else list(name)

        def register(parser_cls):
            for n in names:
                if cls.reasoning_parsers.get(n, parser_cls) is not parser_cls:
                    raise ValueError(f"reasoning parser {n!r} is already registered "
                                     f"({cls.reasoning_parsers[n].__name__})")
                cls.reasoning_parsers[n] = parser_cls
            return parser_cls
        return register

    @classmethod
    def names(cls) -> list[str]:
        """The registered names, sorted (the ``--reasoning-parser`` choices)."""
        return sorted(cls.reasoning_parsers)

    @classmethod
    def get_reasoning_parser(cls, name: str) -> Callable:
        """The parser class registered as ``name``.

        Raises:
            ValueError: an unknown name (the message lists the known ones).
        """
        if name not in cls.reasoning_parsers:
            raise ValueError(f"unknown reasoning_parser {name!r}; known parsers: {', '.join(cls.names())}")
        return cls.reasoning_parsers[name]


def get_reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser called ``name`` built for ``tokenizer`` (None: no reasoning).

    Raises:
        ValueError: an unknown name (the known ones listed), or a tokenizer without its markers.
    """
    if name is None:
        return None
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
