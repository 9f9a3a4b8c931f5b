"""Grammar work for speculative decoding (the manager calls these; vLLM v1 does the same with
xgrammar / llguidance: validate the drafts, fill one mask per verified row, roll back).

A request with ``k`` drafts samples ``k + 1`` rows in one step: row ``j`` follows
``drafts[:j]``, so its mask is the grammar's mask after those ``j`` tokens. The drafts are
accepted tentatively to fill the rows and then rolled back, all of them: after the step the
scheduler feeds the matcher only the tokens it took (``StructuredOutputManager.accept_token``),
so its state is exactly that of decoding without drafts.

With a reasoning parser the rows split where the drafts cross the reasoning's end marker
(``row_plan``): rows while the reasoning runs are free (all bits set, as a row without a
mask), the row after the end marker and later ones get the grammar's masks from its start
state after the drafts past the marker. Where the first token decides (``MAYBE``), row 0 is
the grammar's mask plus the start marker; a first draft that is the start marker opens the
reasoning for the rows after it.
"""

from __future__ import annotations

import torch

from atlas_vlm.reasoning import ENDED, MAYBE, REASONING
from atlas_vlm.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar


def allowed_prefix(grammar: StructuredOutputGrammar, drafts: list[int]) -> int:
    """How many of ``drafts``, from the start, ``grammar`` accepts from its current state
    (nothing is consumed); 0 for a grammar that has already ended."""
    if not drafts or grammar.is_terminated():
        return 0
    return min(len(drafts), max(0, grammar.validate_tokens(drafts)))


def row_plan(reasoning: str, drafts: list[int], start_token_id: int | None,
             end_token_id: int | None) -> list[tuple[int, list[int]]]:
    """Which of a request's ``len(drafts) + 1`` verified rows its grammar constrains.

    Args:
        reasoning: the request's state before the drafts (``ENDED``, ``REASONING``, ``MAYBE``).
        drafts: its drafts (already cut by ``draft_prefix``).
        start_token_id, end_token_id: the reasoning markers (None without a parser).

    Returns:
        ``[(first_row, grammar_drafts)]``: rows ``first_row .. first_row + len(grammar_drafts)``
        get the grammar's masks from its current state after ``grammar_drafts[:j]``; rows no
        entry covers are free (the reasoning runs there). Empty: every row is free.

    Raises:
        ValueError: ``reasoning`` is not one of the three states.
    """
    if reasoning == ENDED:
        return [(0, list(drafts))]
    if reasoning == MAYBE:
        if drafts and drafts[0] == start_token_id:  # the first token opens the reasoning
            return [(0, [])] + [(first + 1, rest) for first, rest in
                                row_plan(REASONING, drafts[1:], start_token_id, end_token_id)]
        return [(0, list(drafts))]
    if reasoning != REASONING:
        raise ValueError(f"reasoning state {reasoning!r} is not one of {ENDED!r}, {REASONING!r}, {MAYBE!r}")
    if end_token_id not in drafts:
        return []
    end = drafts.index(end_token_id)  # rows 0 .. end follow the reasoning; the marker ends it
    return [(end + 1, list(drafts[end + 1:]))]


def fill_step_masks(backend: StructuredOutputBackend,
                    segments: list[tuple[StructuredOutputGrammar, int, list[int]]], bitmask: torch.Tensor) -> None:
    """Fill a step's bitmask: ``segments[i] = (grammar, first_row, drafts)`` owns rows
    ``first_row .. first_row + len(drafts)``, row ``first_row + j`` the mask after
    ``drafts[:j]``; rows no segment covers keep all bits set (free).

    Segments without drafts are filled in one batch by ``backend.fill_bitmasks`` (in parallel
    where the library can); each drafted one's rows one by one with
    ``StructuredOutputGrammar.fill_draft_bitmasks`` (its state is unchanged afterwards).

    Args:
        bitmask: int32 ``[rows, words]``, all bits set.
    """
    plain_rows, plain = [], []
    for grammar, first_row, drafts in segments:
        if drafts:
            grammar.fill_draft_bitmasks(bitmask, first_row, drafts)
        else:
            plain_rows.append(first_row)
            plain.append(grammar)
    if not plain:
        return
    if plain_rows == list(range(bitmask.shape[0])):
        backend.fill_bitmasks(plain, bitmask)
        return
    part = torch.full((len(plain), bitmask.shape[1]), -1, dtype=bitmask.dtype)
    backend.fill_bitmasks(plain, part)
    bitmask[plain_rows] = part


def draft_prefix_with_reasoning(grammar: StructuredOutputGrammar, reasoning: str, drafts: list[int],
                                start_token_id: int | None, end_token_id: int | None) -> int:
    """How many of ``drafts`` to keep for a request in state ``reasoning``: drafts while the
    reasoning runs are free (the end marker included); the drafts ``row_plan`` hands the
    grammar are cut at the first one it refuses from its current state (nothing is consumed).

    Raises:
        ValueError: ``reasoning`` is not one of the three states (``row_plan``).
    """
    for first_row, grammar_drafts in row_plan(reasoning, drafts, start_token_id, end_token_id):
        kept = allowed_prefix(grammar, grammar_drafts)
        if kept < len(grammar_drafts):
            return first_row + kept
    return len(drafts)
