"""The tool-call parser interface and its registry (as vLLM's ``ToolParser`` and
``ToolParserManager``, ``vllm/entrypoints/openai/tool_parsers/abstract_tool_parser.py``).

A parser states its format: *block* markers (``<tool_call>`` .. ``</tool_call>``, one call
each), *tags* after which JSON calls follow (``<|python_tag|>``, ``[TOOL_CALLS]``), and whether
bare or fenced (```` ```json ````) JSON calls naming a requested tool count (``json_calls``).
One incremental scan (``atlas_vlm.tool_parsers.streaming``) reads an output with it, whole
(``extract``) or streamed, with the same result. Rules, for every format:

- the text around the calls is content, in order (None if blank); a piece between or after
  calls made only of whitespace (or the format's separators, Llama's ``;``) is dropped;
- a last call cut by the end of the output (``max_tokens``) is dropped, the calls before it kept;
- a closed block that is not a call, and JSON that is not a call of a requested tool, are content.
"""

from __future__ import annotations

from collections.abc import Callable

from atlas_vlm.tool_parsers.streaming import ToolCallStreamer


class ToolParser:
    """One tool-call format, stated by the class attributes below; a format with block markers
    implements ``parse_block``.

    Args:
        tools: the request's OpenAI tool definitions (their names decide which bare / fenced
            JSON objects are calls; a parser may read the parameter schemas, e.g. to type XML
            values); None or [] when unknown (then no bare JSON is a call).
    """

    name = ""
    #: start -> end of the blocks holding one call each (their body read by ``parse_block``)
    block_markers: dict[str, str] = {}
    #: markers after which JSON calls of any name follow (separated by ``separators``)
    tags: tuple[str, ...] = ()
    #: bare or fenced JSON calls of a requested tool are calls (anywhere in the text)
    json_calls = False
    #: JSON calls of any name may open the reply without a tag (the tag is a special token
    #: the detokenizer drops; forced calls are written without it)
    lenient_start = False
    #: characters a piece of text between calls may consist of and still be dropped
    separators = " \t\r\n"
    #: the JSON keys of the arguments, in the order looked for
    arguments_keys: tuple[str, ...] = ("arguments", "parameters")
    #: how tool_choice "required" / a named function is enforced (structured_output.tool_calls):
    #: "hermes", "llama3_json" or "mistral"; None: it is refused
    forced_call_style: str | None = None

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self.tool_names = {(t.get("function") or {}).get("name") for t in self.tools} - {None}

    @property
    def markers(self) -> list[str]:
        """The block markers' starts and the tags."""
        return [*self.block_markers, *self.tags]

    def parse_block(self, body: str) -> tuple[str, str] | None:
        """``(function name, arguments JSON text)`` of one block's body, or None if it is not a call."""
        return None

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a whole output, calls in OpenAI's shape
        (``{"id", "type": "function", "function": {"name", "arguments"}}``); the rules are
        the module's."""
        streamer = ToolCallStreamer(self)
        content, deltas = streamer.feed(text, True)
        calls = [{"id": d["id"], "type": "function", "function": d["function"]} for d in deltas]
        return (content if content.strip() or not streamer.dropped else None), calls


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
