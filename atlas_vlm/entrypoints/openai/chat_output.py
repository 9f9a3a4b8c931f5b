"""One chat choice's output as OpenAI shows it: the reasoning / tool-call split
(``entrypoints.chat_split``, the one split every entrypoint uses) shaped as a whole ``message``
or as stream ``delta``s, with ``finish_reason`` ``"tool_calls"`` when calls were made. Streamed,
each step's new text is parsed once (``ChatOutputSplitter`` reads only what it adds)."""

from __future__ import annotations

from atlas_vlm.entrypoints.chat_split import ChatOutputSplitter, split_output
from atlas_vlm.reasoning import ENDED
from atlas_vlm.tool_parsers import ToolParser
from atlas_vlm.tool_parsers.hermes import HermesToolParser

__all__ = ["ChatChoiceOutput", "split_output"]


class ChatChoiceOutput:
    """Per choice: turns ``RequestOutput``s into a message or deltas.

    Args:
        reasoning_parser: a ``ReasoningParser`` or None (no split).
        parse_tools: look for tool calls in the content (``tools`` given, ``tool_choice`` not "none").
        tool_parser: the request's ``ToolParser`` instance (None: Hermes).
    """

    def __init__(self, reasoning_parser=None, parse_tools: bool = False, tool_parser: ToolParser | None = None):
        self.reasoning_parser = reasoning_parser
        self.parse_tools = parse_tools
        self.tool_parser = tool_parser or HermesToolParser()
        self.splitter = ChatOutputSplitter(reasoning_parser, self.tool_parser if parse_tools else None)
        self.seen = 0  # ``delta``: characters of the CUMULATIVE text already fed

    @property
    def called(self) -> bool:
        """A tool call was streamed (``delta`` / ``feed_delta``)."""
        return self.splitter.called

    def message(self, out) -> tuple[dict, str | None]:
        """``(message, finish_reason)`` of a finished output."""
        state = self.reasoning_parser.initial_state(out.prompt_token_ids) if self.reasoning_parser else ENDED
        reasoning, content, calls = split_output(out.text, self.reasoning_parser, state,
                                                 self.tool_parser if self.parse_tools else None)
        msg = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg, _finish(out.finish_reason, bool(calls))

    def delta(self, out) -> tuple[dict, str | None]:
        """``(delta fields, finish_reason)`` for a CUMULATIVE output (``out.text``: the text so
        far): ``reasoning_content``, ``content`` and ``tool_calls`` keys only where something
        new is shown."""
        new, self.seen = out.text[self.seen:], len(out.text)
        return self._delta(new, out)

    def feed_delta(self, out) -> tuple[dict, str | None]:
        """As :meth:`delta` for the next DELTA output of the choice (``out.text``: the step's new
        text; the first one carries the prompt ids, which set the reasoning parser's state)."""
        return self._delta(out.text, out)

    def _delta(self, new_text: str, out) -> tuple[dict, str | None]:
        reasoning, content, calls = self.splitter.feed(new_text, out.finished, out.prompt_token_ids)
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = calls
        if content:
            delta["content"] = content
        return delta, (_finish(out.finish_reason, self.splitter.called) if out.finished else None)


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason
