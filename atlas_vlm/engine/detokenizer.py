"""Incremental detokenization: the text of a growing list of generated ids at a cost per
token that does not grow with the output.

``IncrementalDetokenizer`` follows vLLM's ``detokenize_incrementally`` (vllm/transformers_utils/
detokenizer_utils.py) with prefix/read offsets over *ids*: each step decodes only the window
``ids[prefix_offset:]`` and the already-read part ``ids[prefix_offset:read_offset]`` and keeps
the difference; text ending in U+FFFD (an incomplete UTF-8 character of byte-level or
byte-fallback tokens) is held back until more ids complete it. Unlike vLLM, the window starts
at the first generated id (no prompt context), so the text equals ``tokenizer.decode(ids)``.

``CleanupStream`` applies HF ``clean_up_tokenization`` (`` .`` -> ``.``, `` n't`` -> ``n't``,
...) when the tokenizer has ``clean_up_tokenization_spaces`` set, committing text only at
cuts where cleaning the parts separately equals cleaning the whole (see ``_safe_cut``).
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
_PATTERN_LEN = 4  # longest pattern of HF clean_up_tokenization (" n't", " 've", ...)


class IncrementalDetokenizer:
    """Text of the ids appended so far, produced piece by piece.

    Args:
        tokenizer: a transformers tokenizer (its ``decode``).
        skip_special_tokens: drop special tokens from the text (HF / vLLM default True).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: ids before it are text already read
        self.read_offset = 0  # ids before it have been turned into stable text

    def _decode(self, ids: list[int]) -> str:
        # A fast tokenizer's ``decode`` is its Rust backend's decode, then the optional
        # clean-up (transformers ``PreTrainedTokenizerFast._decode``); calling the backend
        # skips the Python wrapper's per-call overhead.
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, new_token_ids: list[int]) -> tuple[str, str]:
        """Append ids; returns ``(stable, pending)``: new text that no later id can change,
        and the text of the unread ids (may end in an incomplete character, U+FFFD)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return "", new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):], ""


def _safe_cut(text: str, k: int) -> bool:
    """Whether ``clean(text[:k] + rest) == clean(text[:k]) + clean(rest)`` for every ``rest``
    starting with ``text[k:]``.

    Every clean-up pattern starts with a space and is at most 4 chars. No match can cross
    ``k`` when (a) no space is among the 3 chars before ``k``, or (b) ``text[k]`` is a space
    and ``text[k-1]`` is none of space, ``'`` (`` ' `` ends in a space) and ``n`` (`` n ' t``
    becomes `` n't`` after `` ' `` is cleaned).
    """
    if " " not in text[max(0, k - (_PATTERN_LEN - 1)):k]:
        return True
    return k < len(text) and text[k] == " " and text[k - 1] not in " 'n"


class CleanupStream:
    """Streams ``tokenizer.clean_up_tokenization`` over appended text (identity when the
    tokenizer does not clean up). ``committed`` only grows; ``tail`` may still change."""

    def __init__(self, tokenizer):
        self.enabled = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.clean = tokenizer.clean_up_tokenization
        self.committed = ""  # cleaned text that no later text changes
        self.tail = ""  # raw text after the last safe cut

    def push(self, raw: str) -> str:
        """Append raw text; returns the newly committed cleaned text."""
        if not self.enabled:
            self.committed += raw
            return raw
        self.tail += raw
        cut = next((k for k in range(len(self.tail), 0, -1) if _safe_cut(self.tail, k)), 0)
        if cut == 0:
            return ""
        done = self.clean(self.tail[:cut])
        self.committed += done
        self.tail = self.tail[cut:]
        return done

    def tail_text(self, pending: str) -> str:
        """The cleaned text after ``committed`` if the output ended now with ``pending`` raw
        text after the tail: ``committed + tail_text(pending)`` is the whole cleaned text."""
        rest = self.tail + pending
        return self.clean(rest) if self.enabled and rest else rest
