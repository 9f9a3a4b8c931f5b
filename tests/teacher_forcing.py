"""Teacher forcing through ``ModelRunner.observers`` (no patching): record every sampled
step's logits per request, and optionally make each step emit given tokens, so two engines'
logits are compared along the same trajectory."""

from __future__ import annotations

import torch


def record_logits(llm, forced: dict[tuple, list[int]] | None = None) -> dict[tuple, list[torch.Tensor]]:
    """Install an observer on ``llm``'s runner; returns the dict it fills: prompt ids (a tuple)
    -> fp32 logits ``[vocab]`` of each sampled step, in order. ``forced``: {prompt ids: tokens}
    makes step ``j`` of that request emit ``tokens[j]`` (its own logits are recorded first)."""
    logits: dict[tuple, list[torch.Tensor]] = {}

    def observe(chunks, inp, step_logits, sampled):
        for row, index in enumerate(sampled):
            req = chunks[index][0]
            key = tuple(req.token_ids[:req.num_prompt_tokens])
            logits.setdefault(key, []).append(step_logits[row].float().clone())
            if forced is not None:
                step_logits[row] = -1e9
                step_logits[row, forced[key][req.num_output_tokens]] = 0.0

    llm.engine.runner.observers.append(observe)
    return logits
