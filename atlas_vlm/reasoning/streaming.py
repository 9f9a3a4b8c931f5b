"""The reasoning split read from a growing output, incrementally, for any ``ReasoningParser``:
the one scan behind both ``ReasoningParser.extract_reasoning`` (the whole output at once) and
streaming, so the two agree.

The scan keeps where it is (``pos``: the text before it is decided and sent) and reads only
the text a feed adds: while the output may still open with the start marker it waits (blanks,
or a prefix of the marker); inside the reasoning it looks for the end marker from where the
last feed stopped, holding back a suffix that may grow into the marker; after the marker it
drops the newlines, and the rest is content. Rules (vLLM's ``DeepSeekR1ReasoningParser``):
an unclosed reasoning (``max_tokens`` hit while thinking) is all reasoning; with ``MAYBE`` the
output is reasoning only if it opens (after blanks) with the start marker, else all content.
"""

from __future__ import annotations

#: Where a request's output is with respect to its reasoning (``ReasoningParser.initial_state``).
MAYBE, REASONING, ENDED = "maybe", "reasoning", "ended"
_OPENING, _INSIDE, _AFTER_END, _CONTENT = "opening", "inside", "after_end", "content"
_FIRST_PHASE = {MAYBE: _OPENING, REASONING: _INSIDE, ENDED: _CONTENT}


class ReasoningStreamer:
    """Per choice: feed the whole output so far, get the new reasoning and content.

    Args:
        parser: the request's ``ReasoningParser`` (``atlas_vlm.reasoning.abstract``; its
            ``start`` / ``end`` texts).
        state: where the output starts (``parser.initial_state(prompt ids)``).

    Attributes:
        opened: a reasoning was opened (by the prompt or by the output's start marker).
        scanned: the characters the scan has passed over so far (its work; each character of
            the output is examined about once, ``tests/engine/test_parse_once.py``).

    Raises:
        ValueError: ``state`` is not ``MAYBE``, ``REASONING`` or ``ENDED``.
    """

    def __init__(self, parser, state: str = MAYBE):
        if state not in _FIRST_PHASE:
            raise ValueError(f"reasoning state {state!r} is not one of {sorted(_FIRST_PHASE)}")
        self.parser = parser
        self.phase = _FIRST_PHASE[state]
        self.opened = state == REASONING
        self.pos = 0  # the text before it is decided (sent as reasoning, content or a marker)
        self.blank = 0  # _OPENING: the output is blank up to here
        self.scanned = 0

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """``(reasoning delta, content delta)`` for the output ``text`` so far (it extends the
        text of the previous feed; ``finished``: it is the whole output). Text a later token
        could move to the other side is held back until it cannot."""
        reasoning = ""
        if self.phase == _OPENING and not self._opening(text, finished):
            return "", ""
        if self.phase == _INSIDE:
            end = self.parser.end
            k = text.find(end, self.pos)
            if k == -1:
                self.scanned += len(text) - self.pos
                stop = len(text) if finished else len(text) - self._partial(text, end)
                reasoning, self.pos = text[self.pos:stop], max(self.pos, stop)
                return reasoning, ""
            self.scanned += k + len(end) - self.pos
            reasoning, self.pos, self.phase = text[self.pos:k], k + len(end), _AFTER_END
        if self.phase == _AFTER_END:
            k = self.pos
            while k < len(text) and text[k] == "\n":
                k += 1
            self.scanned += k - self.pos
            self.pos = k
            if k == len(text) and not finished:
                return reasoning, ""
            self.phase = _CONTENT
        content, self.pos = text[self.pos:], len(text)  # _CONTENT: everything after is content
        self.scanned += len(content)
        return reasoning, content

    def _opening(self, text: str, finished: bool) -> bool:
        """Whether the output's opening is decided (the phase set), reading only new text."""
        k = self.blank
        while k < len(text) and text[k].isspace():  # str.lstrip()'s blanks
            k += 1
        start = self.parser.start
        head = text[k:k + len(start)]
        self.scanned += k - self.blank + len(head)
        self.blank = k
        if head == start:
            self.phase, self.opened, self.pos = _INSIDE, True, k + len(start)
            return True
        if not finished and start.startswith(head):  # blanks only, or a prefix of the marker
            return False
        self.phase, self.pos = _CONTENT, 0  # no reasoning: the whole output (blanks too) is content
        return True

    def _partial(self, text: str, marker: str) -> int:
        """Length of the longest suffix of ``text`` after ``pos`` that may grow into ``marker``."""
        for k in range(min(len(marker) - 1, len(text) - self.pos), 0, -1):
            if text.endswith(marker[:k]):
                return k
        return 0
