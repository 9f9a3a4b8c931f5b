"""The tool-call parser interface and its registry (as vLLM's ``ToolParser`` and
``ToolParserManager``, ``vllm/entrypoints/openai/tool_parsers/abstract_tool_parser.py``).

A parser knows where the calls begin in a model's output and how to cut that part into
blocks, one call each, that are either *closed* (the model finished writing them) or still
*open* (the last one, being written or cut by ``max_tokens``). ``extract`` and the streamer
(``atlas_vlm.tool_parsers.streaming``) share that cut, so a whole output and a stream of it
give the same calls. Rules, for every format:

- content is the text before the calls (None if blank); text after the calls is dropped;
- a last open block that does not parse was cut: it is dropped, the calls before it kept;
- a closed block that does not parse means the output was not a call: no calls, the whole
  text is content (vLLM's hermes parser does the same).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable


def new_tool_call_id() -> str:
    """An OpenAI-style call id, ``call_`` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def marker_blocks(text: str, k: int, start: str, end: str) -> list[tuple[str, bool]]:
    """``(body, closed)`` of every ``start``..``end`` block of ``text`` from index ``k`` on."""
    out = []
    pos = text.find(start, k)
    while pos != -1:
        body_start = pos + len(start)
        stop = text.find(end, body_start)
        if stop == -1:
            out.append((text[body_start:], False))
            break
        out.append((text[body_start:stop], True))
        pos = text.find(start, stop + len(end))
    return out


def dump_arguments(args) -> str | None:
    """The OpenAI ``arguments`` string of a parsed arguments value: a dict as JSON text, a
    string as given (some models write the JSON as a string); None for anything else."""
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    return None


class ToolParser(ABC):
    """One tool-call format. Subclasses set ``start`` (or override ``find_start`` /
    ``held_back``) and implement ``blocks`` and ``parse_block``.

    Args:
        tools: the request's OpenAI tool definitions (a parser may read the parameter
            schemas, e.g. to type XML values); None or [] when unknown.
    """

    name = ""
    start = ""  # the text that opens the calls
    #: how tool_choice "required" / a named function is enforced (structured_output.tool_calls):
    #: "hermes", "llama3_json" or "mistral"; None: it is refused
    forced_call_style: str | None = None

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []

    def find_start(self, text: str) -> int:
        """Index in ``text`` where the calls begin (the content ends there), or -1."""
        return text.find(self.start)

    def held_back(self, text: str) -> int:
        """While streaming, with no calls begun yet: how many trailing characters of ``text``
        may still become the start of a call (not sent as content yet)."""
        return partial_suffix(text, self.start)

    @abstractmethod
    def blocks(self, text: str, k: int) -> list[tuple[str, bool]]:
        """``(body, closed)`` of each call block of ``text``, the calls beginning at ``k``."""

    @abstractmethod
    def parse_block(self, body: str) -> tuple[str, str] | None:
        """``(function name, arguments JSON text)`` of one block, or None if it is not a call."""

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a whole output, calls in OpenAI's shape
        (``{"id", "type": "function", "function": {"name", "arguments"}}``); the rules are
        the module's."""
        k = self.find_start(text)
        if k == -1:
            return text, []
        calls = []
        blocks = self.blocks(text, k)
        for n, (body, closed) in enumerate(blocks):
            split = self.parse_block(body)
            if split is None and not closed and n == len(blocks) - 1:
                break
            if split is None:
                return text, []
            calls.append({"id": new_tool_call_id(), "type": "function",
                          "function": {"name": split[0], "arguments": split[1]}})
        content = text[:k]
        return (content if content.strip() else None), calls


class ToolParserManager:
    """The registry of tool-call parsers by name (vLLM's ``--tool-call-parser`` names)."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str | list[str]) -> Callable[[type[ToolParser]], type[ToolParser]]:
        """Class decorator registering a ``ToolParser`` under ``name`` (or several names).

        Raises:
            ValueError: a name already registered to another class.
        """
        names = [name] if isinstance(name, str) else list(name)

        def register(parser_cls: type[ToolParser]) -> type[ToolParser]:
            for n in names:
                if cls.tool_parsers.get(n, parser_cls) is not parser_cls:
                    raise ValueError(f"tool parser {n!r} is already registered ({cls.tool_parsers[n].__name__})")
                cls.tool_parsers[n] = parser_cls
            parser_cls.name = parser_cls.name or names[0]
            return parser_cls
        return register

    @classmethod
    def names(cls) -> list[str]:
        """The registered names, sorted."""
        return sorted(cls.tool_parsers)

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class registered as ``name``.

        Raises:
            ValueError: an unknown name (the message lists the known ones).
        """
        if name not in cls.tool_parsers:
            raise ValueError(f"unknown tool_call_parser {name!r}; known parsers: {', '.join(cls.names())}")
        return cls.tool_parsers[name]
