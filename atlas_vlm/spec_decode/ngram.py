"""N-gram (prompt-lookup) draft proposer: the draft tokens of exact speculative decoding.

The rule (vLLM's ``NgramProposer``, "prompt lookup decoding", Saxena 2023): take the last
``n`` tokens of the request (prompt + output so far), for ``n`` from ``max_n`` down to
``min_n``; find where that n-gram occurred earlier in the same tokens, the most recent
occurrence first, and propose the (up to ``k``) tokens that followed it. The longest n-gram
with a usable continuation wins.

Media placeholder runs are no text: an n-gram may not match inside one, a continuation stops
before one, and placeholder ids are never proposed (a drafted pad token would be a token
with no encoder row). Pure numpy, O(len(tokens) * max_n) per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["NgramProposer"]


class NgramProposer:
    """Proposes draft tokens by prompt lookup.

    Args:
        max_n: longest n-gram to look up (tokens, >= min_n).
        min_n: shortest n-gram to look up (tokens, >= 1).
        placeholder_token_ids: ids that are never proposed (image / video pads).

    Raises:
        ValueError: ``min_n < 1`` or ``max_n < min_n``.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1, placeholder_token_ids: Iterable[int] = ()):
        if isinstance(min_n, bool) or not isinstance(min_n, int) or min_n < 1:
            raise ValueError(f"min_n must be an int >= 1 (tokens), got {min_n!r}")
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < min_n:
            raise ValueError(f"max_n must be an int >= min_n ({min_n}), got {max_n!r}")
        self.max_n, self.min_n = max_n, min_n
        self.placeholder_token_ids = np.array(sorted(set(placeholder_token_ids)), dtype=np.int64)

    def _masked(self, tokens: np.ndarray, media_ranges: Iterable) -> np.ndarray:
        """``[len(tokens)]`` bool: True at placeholder ids and inside media runs."""
        masked = np.isin(tokens, self.placeholder_token_ids)
        for r in media_ranges:
            masked[r.offset:r.offset + r.length] = True
        return masked

    def propose(self, token_ids: Sequence[int], k: int, media_ranges: Iterable = (),
                request_id: str | None = None) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids``.

        Args:
            token_ids: the request's prompt + output ids so far.
            k: drafts wanted at most (``<= 0``: none).
            media_ranges: the request's placeholder runs (objects with ``offset`` and
                ``length``, e.g. ``PlaceholderRange``); none of their tokens is matched or
                proposed.
            request_id: unused (the MTP proposer's drafts are per request).

        Returns:
            the drafts (maybe fewer than ``k``, maybe none): the continuation of the most
            recent earlier occurrence of the longest suffix n-gram that has one.
        """
        num = len(token_ids)
        if k <= 0 or num < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        masked = self._masked(tokens, media_ranges)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            if masked[num - n:].any():
                continue  # the suffix itself reaches into media: no text n-gram of this length
            # windows starting at s = 0 .. num-n-1: each leaves >= 1 token after it
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:num - 1], n)
            hit = (windows == tokens[num - n:]).all(axis=1)
            if masked.any():
                hit &= ~np.lib.stride_tricks.sliding_window_view(masked[:num - 1], n).any(axis=1)
            for s in np.flatnonzero(hit)[::-1]:  # most recent first
                follow = slice(s + n, min(s + n + k, num))
                stop = np.flatnonzero(masked[follow])
                end = follow.start + (int(stop[0]) if stop.size else follow.stop - follow.start)
                if end > follow.start:
                    return tokens[follow.start:end].tolist()
        return []
