"""Grammar work for speculative decoding (the manager calls these; vLLM v1 does the same with
xgrammar / llguidance: validate the drafts, fill one mask per verified row, roll back).

A request with ``k`` drafts samples ``k + 1`` rows in one step: row ``j`` follows
``drafts[:j]``, so its mask is the grammar's mask after those ``j`` tokens. The drafts are
accepted tentatively to fill the rows and then rolled back, all of them: after the step the
scheduler feeds the matcher only the tokens it took (``StructuredOutputManager.accept_token``),
so its state is exactly that of decoding without drafts.
"""

from __future__ import annotations

import torch

from atlas_vlm.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar


def allowed_prefix(grammar: StructuredOutputGrammar, drafts: list[int]) -> int:
    """How many of ``drafts``, from the start, ``grammar`` accepts from its current state
    (nothing is consumed); 0 for a grammar that has already ended."""
    if not drafts or grammar.is_terminated():
        return 0
    return min(len(drafts), max(0, grammar.validate_tokens(drafts)))


def fill_step_masks(backend: StructuredOutputBackend, entries: list[tuple[StructuredOutputGrammar, list[int]]],
                    bitmask: torch.Tensor) -> None:
    """Fill a step's bitmask: ``entries[i] = (grammar, drafts)`` owns the next
    ``len(drafts) + 1`` rows, in order (one row without drafts).

    Rows without drafts are filled in one batch by ``backend.fill_bitmasks`` (in parallel
    where the library can); each drafted request's rows one by one with
    ``StructuredOutputGrammar.fill_draft_bitmasks`` (its state is unchanged afterwards).

    Args:
        bitmask: int32 ``[sum(len(drafts) + 1), words]``, all bits set.
    """
    if not any(drafts for _, drafts in entries):
        backend.fill_bitmasks([g for g, _ in entries], bitmask)
        return
    plain_rows, plain, row = [], [], 0
    for grammar, drafts in entries:
        if drafts:
            grammar.fill_draft_bitmasks(bitmask, row, drafts)
        else:
            plain_rows.append(row)
            plain.append(grammar)
        row += len(drafts) + 1
    if plain:
        part = torch.full((len(plain), bitmask.shape[1]), -1, dtype=bitmask.dtype)
        backend.fill_bitmasks(plain, part)
        bitmask[plain_rows] = part
