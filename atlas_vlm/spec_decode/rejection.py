"""Speculative sampling for requests with ``temperature > 0`` (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023).

An n-gram draft is a point mass ``q = onehot(x)``. At each drafted row the target's sampling
distribution ``p`` (after temperature, top-k and top-p, as ``worker.sampler`` samples) accepts
``x`` with probability ``min(1, p(x) / q(x)) = p(x)``; on reject the row's token is drawn
from ``normalize(max(p - q, 0))``, i.e. ``p`` with ``x`` removed, and the run ends. If every
draft is accepted, the last row's token is drawn from its ``p``. Each emitted token is then
distributed exactly as the target's, whatever the drafts. Draws use the request's own
generator (a seeded request is reproducible with the same drafts; its tokens differ from a
run without speculation, their distribution does not).

``sample_with_drafts`` wraps ``worker.sampler.sample``: rows of sampled (non-greedy) requests
with drafts go through ``rejection_sample``, every other row through ``sample`` unchanged.
Logit bias and penalties apply to every verified row first, row ``j`` counting the ``j``
drafts before it (``worker.logits_processors``), so ``p`` is the undrafted step's.
"""

from __future__ import annotations

import torch

from atlas_vlm.structured_output.backend import apply_token_bitmask
from atlas_vlm.sample_ops import params_text, request_logprobs, sampling_probs
from atlas_vlm.worker.logits_processors import apply_penalties
from atlas_vlm.worker.sampler import SamplerOutput, sample


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """Tokens of one request's ``k + 1`` verified rows.

    Args:
        probs: ``[k + 1, vocab]`` the target's sampling probabilities at each row (row ``j``
            follows draft ``j``; row 0 follows the last sampled token).
        drafts: the ``k`` draft tokens.
        generator: the request's generator (on ``probs``' device), or None (torch's global one).

    Returns:
        ``k + 1`` tokens: ``drafts[j]`` at every accepted row, the replacement drawn at the
        first rejected row (never its draft), copies of it after (rows never taken); the
        last row's own draw if all were accepted.
    """
    out: list[int] = []
    for j, x in enumerate(drafts):
        u = torch.rand((), generator=generator, device=probs.device)
        if bool(u < probs[j, x]):
            out.append(x)
            continue
        residual = probs[j].clone()
        residual[x] = 0.0  # max(p - onehot(x), 0) up to normalisation (multinomial normalises)
        if not bool(residual.sum() > 0):  # p(x) is 1 up to rounding: x is the only token left
            out.append(x)
            continue
        token = int(torch.multinomial(residual, 1, generator=generator))
        return out + [token] * (len(drafts) + 1 - j)
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=generator))]


def _verify_rows(logits: torch.Tensor, raw: torch.Tensor, req, rows: list[int], out: SamplerOutput) -> None:
    """Fill ``out`` at ``rows`` (one request's ``k + 1`` rows) by ``rejection_sample`` from
    ``logits`` (penalised), logprobs from ``raw`` (before penalties); a row whose
    distribution is not usable fails the request there (rows after it too)."""
    params = req.sampling_params
    try:
        probs = sampling_probs(logits, [params] * logits.shape[0], rows)  # [k + 1, vocab]
        ok = (torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)).tolist()
        if not all(ok):
            raise ValueError("the filters masked every token or the probabilities are not finite")
        tokens = rejection_sample(probs, req.spec_token_ids, req.generator)
    except Exception as e:  # noqa: BLE001 - this request fails alone
        for r in rows:
            out.errors[r] = (f"request {req.request_id!r}: sampling with {params_text(params)} failed "
                             f"({type(e).__name__}: {e})")
        return
    asked = params.logprobs is not None
    lps, tops = request_logprobs(raw[rows], torch.tensor(tokens, device=logits.device), [req] * len(rows),
                                 list(range(len(rows))) if asked else [])
    for j, r in enumerate(rows):
        out.token_ids[r], out.logprobs[r], out.top_logprobs[r] = tokens[j], lps[j], tops[j]


def sample_with_drafts(logits: torch.Tensor, requests: list, grammar_bitmask=None) -> SamplerOutput:
    """``worker.sampler.sample`` over a step's rows, where the rows of a sampled request
    with drafts (``spec_token_ids``; consecutive, ``k + 1`` of them) are verified by
    ``rejection_sample``. Args and return as ``sample`` (``grammar_bitmask`` rows index
    ``requests``; a drafted request with a grammar has one mask per row, row ``j`` the
    grammar's mask after ``j`` drafts: those rows are masked before the verification)."""
    spec = [j for j, r in enumerate(requests) if r.spec_token_ids and not r.sampling_params.greedy]
    if not spec:
        return sample(logits, requests, grammar_bitmask)
    spec_set = set(spec)
    plain = [j for j in range(len(requests)) if j not in spec_set]
    masks = None
    if grammar_bitmask is not None:
        where = {j: i for i, j in enumerate(plain)}
        g_rows, g_mask = grammar_bitmask
        keep = [i for i, j in enumerate(g_rows) if j in where]
        masks = ([where[g_rows[i]] for i in keep], g_mask[keep])
        drafted = [i for i, j in enumerate(g_rows) if j in spec_set]
        if drafted:  # the verified rows sample from the masked distribution (logprobs too)
            idx = torch.tensor([g_rows[i] for i in drafted], device=logits.device)
            logits = logits.index_copy(0, idx, apply_token_bitmask(logits[idx], g_mask[drafted]))
    part = sample(logits[plain], [requests[j] for j in plain], masks)
    sidx = torch.tensor(spec, device=logits.device)
    penalised, pen_rows = apply_penalties(logits[sidx], [requests[j] for j in spec])  # [len(spec), vocab]
    verified = logits.index_copy(0, sidx, penalised) if pen_rows else logits
    n = len(requests)
    out = SamplerOutput([None] * n, [None] * n, [None] * n, [None] * n)
    for i, j in enumerate(plain):
        out.token_ids[j], out.logprobs[j] = part.token_ids[i], part.logprobs[i]
        out.top_logprobs[j], out.errors[j] = part.top_logprobs[i], part.errors[i]
    j = 0
    while j < len(spec):
        req = requests[spec[j]]
        rows = spec[j:j + len(req.spec_token_ids) + 1]
        _verify_rows(verified, logits, req, rows, out)
        j += len(rows)
    return out
