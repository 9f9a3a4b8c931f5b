"""Streaming tool calls: a growing output -> content deltas and OpenAI ``tool_calls`` deltas,
for any ``ToolParser``.

A call is sent whole (``index``, ``id``, ``type``, ``function.name`` and ``function.arguments``
in one delta) once its block is closed, or at the end if the open last block parses: a call
cut by ``max_tokens`` is never sent, so the streamed calls are exactly those the parser's
``extract`` finds in the whole output. Content is sent up to where the calls begin, holding
back text that may still turn out to begin them; an output that ends without any call and
that ``extract`` reads as all content gets its held text sent at the end.
"""

from __future__ import annotations

from atlas_vlm.tool_parsers.abstract import ToolParser, new_tool_call_id


class ToolCallStreamer:
    """Per choice: feed the whole output so far, get what is new.

    Args:
        parser: the request's ``ToolParser`` instance.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.content_sent = 0
        self.blocks_done = 0  # blocks sent or dropped
        self.calls: list[dict] = []  # per sent call: id, name

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """``(content delta, tool_call deltas)`` for the output ``text`` so far (``finished``:
        it is the whole output)."""
        k = self.parser.find_start(text)
        content_end = len(text) if k == -1 else k
        if k == -1 and not finished:
            content_end -= self.parser.held_back(text)
        content = text[self.content_sent:content_end] if content_end > self.content_sent else ""
        self.content_sent = max(self.content_sent, content_end)
        deltas: list[dict] = []
        if k == -1:
            return content, deltas
        for i, (body, closed) in enumerate(self.parser.blocks(text, k)):
            if i < self.blocks_done:
                continue
            if not closed and not finished:
                break
            self.blocks_done = i + 1
            split = self.parser.parse_block(body)
            if split is None:
                continue
            call = {"id": new_tool_call_id(), "name": split[0]}
            deltas.append({"index": len(self.calls), "id": call["id"], "type": "function",
                           "function": {"name": split[0], "arguments": split[1]}})
            self.calls.append(call)
        if finished and not self.calls and self.parser.extract(text) == (text, []):
            content += text[self.content_sent:]  # not calls after all: the held text is content
            self.content_sent = len(text)
        return content, deltas
