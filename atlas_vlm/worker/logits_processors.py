"""Logit bias, penalties and min-p over a step's ``[num_rows, vocab]`` logits, vectorised.

``apply_penalties`` runs on the raw logits, before temperature (vLLM's order): ``logit_bias``
added, then ``repetition_penalty`` (HF ``RepetitionPenaltyLogitsProcessor`` / vLLM: a token
seen in the prompt or the output has a positive logit divided by the penalty, a negative one
multiplied), then OpenAI's ``logits[t] -= frequency_penalty * count[t] + presence_penalty *
(count[t] > 0)`` with ``count`` over the output tokens only. Counts come from the request's
token ids (a ``[rows, vocab]`` scatter), never from state kept across steps, so a request
recomputed after preemption is penalised as before. A request with ``k`` speculative drafts
has ``k + 1`` consecutive rows; row ``j`` sees the drafts before it (``history_lengths``), so
each verification row is penalised as the undrafted step at that position would be.
Nothing is computed unless some row uses them.

``apply_min_p`` (in ``sample_ops``, beside top-k / top-p; re-exported here) is HF's
``MinPLogitsWarper``: after temperature, top-k and top-p, a token is masked when its
probability is below ``min_p`` times the row's best.
"""

from __future__ import annotations

import torch

from atlas_vlm.sample_ops import apply_min_p  # noqa: F401 - min-p lives with the other filters


def history_lengths(requests) -> list[int]:
    """Per row: how many of its request's ``token_ids`` precede the token the row samples.

    Args:
        requests: one per row (``token_ids``, ``spec_token_ids``); a request with ``k``
            drafts (the last ``k`` of its ``token_ids``) fills ``k + 1`` consecutive rows.
    """
    out: list[int] = []
    j = 0
    for i, r in enumerate(requests):
        j = j + 1 if i and requests[i - 1] is r else 0  # row j of this request: after j drafts
        out.append(len(r.token_ids) - len(getattr(r, "spec_token_ids", ()) or ()) + j)
    return out


def _scatter_counts(seqs: list[list[int]], vocab: int, device) -> torch.Tensor:
    """``[len(seqs), vocab]`` fp32 occurrences of each token id in each sequence (ids outside
    the vocabulary are not counted)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)  # [total]
    rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths)  # [total]
    keep = (ids >= 0) & (ids < vocab)
    counts = torch.zeros(len(seqs), vocab, dtype=torch.float32)
    counts.index_put_((rows[keep], ids[keep]), torch.ones(int(keep.sum())), accumulate=True)
    return counts.to(device)


def apply_penalties(logits: torch.Tensor, requests) -> tuple[torch.Tensor, list[int]]:
    """``logits`` with each row's ``logit_bias`` and penalties applied (module docstring).

    Args:
        logits: ``[num_rows, vocab]`` fp32 raw logits, row ``i`` for ``requests[i]``
            (``sampling_params``, ``token_ids``, ``num_prompt_tokens``, ``spec_token_ids``).
        requests: one per row.

    Returns:
        (the logits, a new tensor if any row changed; the rows that use penalties). Rows
        that use none are left bit for bit as they were.
    """
    rows = [i for i, r in enumerate(requests) if r.sampling_params.uses_penalties]
    if not rows:
        return logits, []
    dev, vocab = logits.device, logits.shape[-1]
    lengths = history_lengths(requests)
    params = [requests[i].sampling_params for i in rows]
    idx = torch.tensor(rows, device=dev)
    x = logits[idx]  # [n, vocab]
    bias = [(j, t, b) for j, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if t < vocab]
    if bias:
        r, t, b = zip(*bias, strict=True)
        x = x.index_put((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                        torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)
    rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = _scatter_counts([requests[rows[j]].token_ids[:lengths[rows[j]]] for j in rep], vocab, dev) > 0
        ridx = torch.tensor(rep, device=dev)
        p = torch.tensor([params[j].repetition_penalty for j in rep], dtype=x.dtype, device=dev)[:, None]
        part = x[ridx]  # [n_rep, vocab]
        part = torch.where(seen, torch.where(part < 0, part * p, part / p), part)
        x = x.index_copy(0, ridx, part)
    pen = [j for j, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if pen:
        seqs = [requests[rows[j]].token_ids[requests[rows[j]].num_prompt_tokens:lengths[rows[j]]] for j in pen]
        counts = _scatter_counts(seqs, vocab, dev)  # [n_pen, vocab]
        pidx = torch.tensor(pen, device=dev)
        freq = torch.tensor([params[j].frequency_penalty for j in pen], dtype=x.dtype, device=dev)[:, None]
        pres = torch.tensor([params[j].presence_penalty for j in pen], dtype=x.dtype, device=dev)[:, None]
        x = x.index_copy(0, pidx, x[pidx] - (freq * counts + pres * (counts > 0)))
    return logits.index_copy(0, idx, x), rows
