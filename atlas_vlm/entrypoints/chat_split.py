"""The one reasoning / tool-call split of a chat choice's output, for every entrypoint: ``LLM.chat``
(``entrypoints/llm.py``), the OpenAI chat and responses routes and the Anthropic route (through
``openai/chat_output.ChatChoiceOutput``, which shapes its results as OpenAI messages / deltas).

One incremental pass per choice (``ChatOutputSplitter``): the new text goes through the
reasoning parser's ``ReasoningStreamer``, the content it lets out through the tool parser's
``ToolCallStreamer``; each reads only what the step added, so a token is parsed once and the
per-step cost does not grow with the answer (``tests/engine/test_parse_once.py``). A finished
output (``split_output``) is the same pass fed once, so streamed and whole agree.
"""

from __future__ import annotations

from atlas_vlm.reasoning import ENDED
from atlas_vlm.tool_parsers import ToolCallStreamer, ToolParser


class ChatOutputSplitter:
    """Per choice: feed each step's new text, get the new reasoning, content and tool calls.

    Args:
        reasoning_parser: a ``ReasoningParser`` or None (no split: all content).
        tool_parser: a ``ToolParser`` instance or None (no tool parsing: no calls).
        state: the reasoning parser's ``initial_state`` for the prompt; None: computed from the
            ``prompt_token_ids`` of the first feed.
    """

    def __init__(self, reasoning_parser=None, tool_parser: ToolParser | None = None, state: str | None = None):
        self.reasoning_parser = reasoning_parser
        self.reasoning = None if reasoning_parser is None or state is None else reasoning_parser.streamer(state)
        self.tools = ToolCallStreamer(tool_parser) if tool_parser is not None else None
        self.text = ""  # the output so far (the reasoning streamer's input)
        self.content = ""  # the content so far (the tool streamer's input)

    @property
    def called(self) -> bool:
        """Some tool call was sent."""
        return self.tools is not None and self.tools.called

    @property
    def scanned(self) -> int:
        """Characters the two scans have passed over so far (their work)."""
        return (self.reasoning.scanned if self.reasoning else 0) + (self.tools.scanned if self.tools else 0)

    def feed(self, new_text: str, finished: bool, prompt_token_ids=None) -> tuple[str, str, list[dict]]:
        """``(reasoning delta, content delta, tool-call deltas)`` for the step's ``new_text``
        (``finished``: the output ends with it). Tool-call deltas are whole calls
        (``index``, ``id``, ``type``, ``function``); text that may still turn out to be a marker
        or a call is held back until it is decided.

        Args:
            prompt_token_ids: the request's prompt ids (read at the first feed, when the
                reasoning parser's start state was not given).
        """
        reasoning, content = "", new_text
        if self.reasoning_parser is not None:
            if self.reasoning is None:
                self.reasoning = self.reasoning_parser.streamer(
                    self.reasoning_parser.initial_state(prompt_token_ids or []))
            text, self.text = self.text, ""  # the only reference: CPython appends in place
            text += new_text
            self.text = text
            reasoning, content = self.reasoning.feed(text, finished)
        if self.tools is None:
            return reasoning, content, []
        text, self.content = self.content, ""
        text += content
        self.content = text
        content, calls = self.tools.feed(text, finished)
        return reasoning, content, calls


def split_output(text: str, reasoning_parser=None, state: str | None = ENDED,
                 tool_parser: ToolParser | None = None) -> tuple[str | None, str | None, list[dict]]:
    """``(reasoning_content, content, tool_calls)`` of a finished output's text, by the same
    pass as streaming (fed once).

    Args:
        reasoning_parser: a ``ReasoningParser`` or None (no split: reasoning None).
        state: the reasoning parser's ``initial_state`` for the request's prompt.
        tool_parser: a ``ToolParser`` instance, or None (no tool parsing: no calls).

    Returns:
        reasoning None when no reasoning was opened; content None when tool parsing took
        text out and left only blanks (``ToolParser.extract``'s rule); calls in OpenAI's shape
        (``{"id", "type": "function", "function": {"name", "arguments"}}``).
    """
    splitter = ChatOutputSplitter(reasoning_parser, tool_parser, state if reasoning_parser is not None else None)
    reasoning, content, deltas = splitter.feed(text, True)
    if reasoning_parser is None or not splitter.reasoning.opened:
        reasoning = None
    if tool_parser is not None and not content.strip() and splitter.tools.dropped:
        content = None
    calls = [{"id": d["id"], "type": "function", "function": d["function"]} for d in deltas]
    return reasoning, content, calls
