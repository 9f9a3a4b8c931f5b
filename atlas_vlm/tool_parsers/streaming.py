"""Tool calls read from a growing output, incrementally, for any ``ToolParser``: the one scan
behind both ``ToolParser.extract`` (the whole output at once) and streaming, so the two agree.

The scan keeps where it is: text before a call's opener (a block marker, a tag, a fence or a
``{`` / ``[`` of the JSON formats) is decided content; a candidate call is read until it is
decided (its block closes, its JSON value closes, or the output ends), each feed reading only
the new text. Held back meanwhile: the candidate, a suffix that may grow into an opener, and a
piece of text that could still be dropped (blank, or only separators after a call). A call is
sent whole (``index``, ``id``, ``type``, ``function.name`` and ``function.arguments`` in one
delta) once decided; a call cut by the end of the output is never sent.
"""

from __future__ import annotations

import re
import uuid

from atlas_vlm.tool_parsers.json_calls import JsonSpan, complete_items, decode_calls

FENCE = "```"
_FENCE_OPEN = re.compile(r"```[\w+-]*[ \t]*(?:\r?\n)?[ \t\r\n]*")
_FENCE_CLOSE = re.compile(r"[ \t\r\n]*```")
_FENCE_CLOSE_PARTIAL = re.compile(r"[ \t\r\n]*`{0,2}\Z")
_VALUE_OPEN = re.compile(r'\{\s*"|\[\s*\{\s*"')
_VALUE_OPEN_PARTIAL = re.compile(r"(?:\{\s*|\[\s*(?:\{\s*)?)\Z")
_CALL_HEAD = re.compile(r'(?:\[\s*)?\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_SPACE = " \t\r\n"
WAIT = None  # a candidate not decided yet


def new_tool_call_id() -> str:
    """An OpenAI-style call id, ``call_`` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class _Block:
    """A call in a block marker's ``start`` .. ``end`` (opening at index ``i``)."""

    def __init__(self, i: int, start: str, end: str):
        self.body = self.searched = i + len(start)
        self.end = end
        self.scanned = 0  # characters the end marker was looked for in

    def step(self, parser, text: str, finished: bool, lenient: bool):
        k = text.find(self.end, self.searched)
        self.scanned += (len(text) if k == -1 else k + len(self.end)) - self.searched
        if k != -1:
            pair = parser.parse_block(text[self.body:k])
            return ("calls", k + len(self.end), [pair], False) if pair else ("content", k + len(self.end))
        self.searched = max(self.body, len(text) - len(self.end) + 1)
        if not finished:
            return WAIT
        pair = parser.parse_block(text[self.body:])  # unclosed: a whole call, or cut (dropped)
        return "calls", len(text), [pair] if pair else [], False


class _Json:
    """A JSON value (object or list of objects) at index ``i``, bare or in a ```` ``` ```` fence."""

    def __init__(self, i: int, fenced: bool):
        self.i, self.fenced, self.span = i, fenced, None
        self.skip = i + (len(FENCE) if fenced else 1)  # where the scan resumes if it is not a call

    @property
    def scanned(self) -> int:
        """Characters of the value read so far (``JsonSpan`` reads each once)."""
        return 0 if self.span is None else self.span.scanned - self.span.start

    def step(self, parser, text: str, finished: bool, lenient: bool):
        names = None if lenient else parser.tool_names
        keys = parser.arguments_keys
        if self.span is None:
            start = self.i
            if self.fenced:
                start = _FENCE_OPEN.match(text, self.i).end()
                if start == len(text):
                    return WAIT if not finished else ("content", self.skip)
            if not _VALUE_OPEN.match(text, start):
                partial = _VALUE_OPEN_PARTIAL.match(text, start)
                return WAIT if partial and not finished else ("content", self.skip)
            self.span = JsonSpan(start)
        state = self.span.feed(text)
        if state == "broken":
            return "content", self.skip
        if state == "open":
            return WAIT if not finished else self._cut(parser, text, names, keys)
        end = self.span.end
        pairs = decode_calls(text[self.span.start:end], keys, names)
        if pairs is None:
            return "content", end
        if self.fenced:
            close = _FENCE_CLOSE.match(text, end)
            if close:
                return "calls", close.end(), pairs, lenient
            if not finished and _FENCE_CLOSE_PARTIAL.match(text, end):
                return WAIT
        return "calls", end, pairs, lenient

    def _cut(self, parser, text: str, names, keys):
        """The output ended inside the value: the whole items of a list of calls are kept, a
        cut call is dropped; what does not look like calls is content."""
        head = _CALL_HEAD.match(text, self.span.start)
        if names is not None and (head is None or head.group(1) not in names):
            return "content", self.skip
        items = complete_items(text, self.span.start, keys, names) if text[self.span.start] == "[" else []
        return "calls", len(text), items, names is None


class ToolCallStreamer:
    """Per choice: feed the whole output so far, get what is new (only the new text is read).

    Args:
        parser: the request's ``ToolParser`` instance.

    Attributes:
        scanned: the characters the scan has passed over so far (its work: the opener search,
            the candidates' reads; about once per character, ``tests/engine/test_parse_once.py``).
    """

    def __init__(self, parser):
        self.parser = parser
        openers = [re.escape(m) for m in parser.markers]
        if parser.json_calls:
            openers += [re.escape(FENCE), r"\{", r"\["]
        self._opener = re.compile("|".join(openers)) if openers else None
        self._prefixes = list(parser.markers) + ([FENCE] if parser.json_calls else [])
        self._longest = max(map(len, self._prefixes), default=1)
        self.sent = 0  # content sent up to here; the current piece starts here until shown
        self.checked = 0  # the unshown piece is droppable up to here
        self.shown = False  # the current piece is (partly) sent
        self.after_call = False  # the current piece follows a call or tag
        self.search = 0  # where the next opener is looked for
        self.lenient = parser.lenient_start  # a call right here may have any name
        self.pending = None  # (index, candidate) being decided
        self.calls: list[dict] = []  # per sent call: id, name
        self.dropped = False  # some text was taken out of the content (calls, tags, blank pieces)
        self._scanned = 0  # by the opener search and decided candidates

    @property
    def scanned(self) -> int:
        """Characters passed over so far (see the class docstring)."""
        return self._scanned + (self.pending[1].scanned if self.pending is not None else 0)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """``(content delta, tool_call deltas)`` for the output ``text`` so far (it extends the
        text of the previous feed; ``finished``: it is the whole output)."""
        out: list[str] = []
        deltas: list[dict] = []
        while True:
            if self.pending is None:
                m = self._opener.search(text, self.search) if self._opener else None
                self._scanned += (len(text) if m is None else m.end()) - self.search
                if m is None:
                    hold = 0 if finished else self._partial(text)
                    self._content(text, len(text) - hold, out, force=finished and not self.dropped)
                    # openers are literals: one not found yet can only start in the held suffix
                    self.search = max(self.search, len(text) - hold)
                    return "".join(out), deltas
                self._content(text, m.start(), out)
                if not finished and self._partial(text) >= len(text) - m.start():
                    return "".join(out), deltas  # e.g. "[TOOL_CA": may still become a tag
                self.pending = (m.start(), self._candidate(m))
            i, candidate = self.pending
            decision = candidate.step(self.parser, text, finished, self.lenient and not self.shown)
            if decision is WAIT:
                return "".join(out), deltas
            self.pending = None
            self._scanned += candidate.scanned
            if decision[0] == "content":
                self.search = decision[1]
                continue
            _, end, pairs, self.lenient = decision
            for name, arguments in pairs:
                call = {"id": new_tool_call_id(), "name": name}
                deltas.append({"index": len(self.calls), "id": call["id"], "type": "function",
                               "function": {"name": name, "arguments": arguments}})
                self.calls.append(call)
            self.sent = self.checked = self.search = end  # the unshown piece before the call is dropped
            self.shown, self.after_call, self.dropped = False, True, True

    def _candidate(self, m: re.Match):
        token = m.group()
        if token in self.parser.block_markers:
            return _Block(m.start(), token, self.parser.block_markers[token])
        if token in self.parser.tags:
            return _Tag(m.start() + len(token))
        return _Json(m.start(), token == FENCE)

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of ``text`` (after ``search``) that may grow into an opener."""
        for k in range(min(self._longest - 1, len(text) - self.search), 0, -1):
            if any(p.startswith(text[-k:]) for p in self._prefixes):
                return k
        return 0

    def _content(self, text: str, end: int, out: list[str], force: bool = False) -> None:
        """Send the content up to ``end``, unless the piece so far may still be dropped."""
        if end <= self.sent:
            return
        if not self.shown and not force:
            chars = self.parser.separators if self.after_call else _SPACE
            k = self.checked
            while k < end and text[k] in chars:
                k += 1
            self.checked = k
            if k == end:
                return
        self.shown = True
        out.append(text[self.sent:end])
        self.sent = end


class _Tag:
    """A tag (``<|python_tag|>``, ``[TOOL_CALLS]``) ending at ``end``: taken out of the content,
    the JSON calls right after it may have any name."""

    scanned = 0

    def __init__(self, end: int):
        self.end = end

    def step(self, parser, text: str, finished: bool, lenient: bool):
        return "calls", self.end, [], True
