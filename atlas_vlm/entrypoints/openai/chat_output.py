"""One chat choice's output as OpenAI shows it: reasoning split from content (a reasoning
parser), tool calls parsed out of the content (a ``atlas_vlm.tool_parsers`` parser), ``finish_reason``
``"tool_calls"`` when calls were made; whole messages and stream deltas alike. ``split_output``
is the one split of a finished output, for the server and ``LLM.chat`` alike; streamed, the tool
calls are read incrementally (``ToolCallStreamer`` reads only each step's new text)."""

from __future__ import annotations

from atlas_vlm.reasoning.qwen3 import ENDED
from atlas_vlm.tool_parsers import ToolCallStreamer, ToolParser
from atlas_vlm.tool_parsers.hermes import HermesToolParser


def split_output(text: str, reasoning_parser=None, state: str = ENDED,
                 tool_parser: ToolParser | None = None) -> tuple[str | None, str | None, list[dict]]:
    """``(reasoning_content, content, tool_calls)`` of a finished output's text.

    Args:
        reasoning_parser: a ``ReasoningParser`` or None (no split: reasoning None).
        state: the reasoning parser's ``initial_state`` for the request's prompt.
        tool_parser: a ``ToolParser`` instance, or None (no tool parsing: no calls).
    """
    reasoning, content = None, text
    if reasoning_parser is not None:
        reasoning, content = reasoning_parser.extract_reasoning(text, state)
    calls: list[dict] = []
    if tool_parser is not None:
        content, calls = tool_parser.extract(content)
    return reasoning, content, calls


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
        self.streamer = ToolCallStreamer(self.tool_parser)
        self.reasoning_sent = ""
        self.content_sent = ""
        self.text = ""  # the text so far, from DELTA outputs (``feed_delta``)
        self.initial = None  # the reasoning parser's state after the prompt (from the first DELTA)

    def _state(self, out) -> str:
        return self.reasoning_parser.initial_state(out.prompt_token_ids) if self.reasoning_parser else ENDED

    def message(self, out) -> tuple[dict, str | None]:
        """``(message, finish_reason)`` of a finished output."""
        reasoning, content, calls = split_output(out.text, self.reasoning_parser, self._state(out),
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
        return self._delta(out.text, out, self._state(out))

    def feed_delta(self, out) -> tuple[dict, str | None]:
        """As :meth:`delta` for the next DELTA output of the choice (``out.text``: the step's new
        text; the first one carries the prompt ids, which set the reasoning parser's state)."""
        if self.initial is None:
            self.initial = self._state(out)
        self.text += out.text
        return self._delta(self.text, out, self.initial)

    def _delta(self, text: str, out, initial) -> tuple[dict, str | None]:
        finished = out.finished
        reasoning, content = "", text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning_streaming(text, finished, initial)
        delta: dict = {}
        if reasoning.startswith(self.reasoning_sent) and len(reasoning) > len(self.reasoning_sent):
            delta["reasoning_content"] = reasoning[len(self.reasoning_sent):]
            self.reasoning_sent = reasoning
        if self.parse_tools:
            new_content, tool_deltas = self.streamer.feed(content, finished)
            if tool_deltas:
                delta["tool_calls"] = tool_deltas
        else:
            new_content = content[len(self.content_sent):] if content.startswith(self.content_sent) else ""
            self.content_sent = content if new_content else self.content_sent
        if new_content:
            delta["content"] = new_content
        return delta, (_finish(out.finish_reason, self.streamer.called) if finished else None)


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason
