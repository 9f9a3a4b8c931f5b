"""Next-token choice for the rows of a step that finished a prompt or a decode, vectorised
over the batch: logit bias and penalties (on the raw logits, ``logits_processors``), then
temperature, top-k, top-p and min-p are tensor ops on ``[num_rows, vocab]``; the
only per-row work is the seeded draw (``torch.multinomial`` with the request's own
generator, so a seeded request gives the same tokens alone or in any batch).

A row whose logits are not usable (NaN, +inf, or no finite value) fails alone: its request
gets an error message and the other rows are sampled as if it were not there. So does a row
whose own parameters make sampling fail (its filters leave no token, a draw or its logprobs
raise): the batched step is redone row by row for that part, the failing row's request gets
an error naming its parameters, and no other row's tokens or generator state change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atlas_vlm.sample_ops import params_text, request_logprobs, sampling_probs
from atlas_vlm.sampling_params import is_greedy
from atlas_vlm.structured_output.backend import apply_token_bitmask
from atlas_vlm.worker.logits_processors import apply_penalties


@dataclass
class SamplerOutput:
    """Per row: the token (``None`` if the row failed), its logprob and top-k logprobs
    (``None`` where not asked) and an error message (``None`` if fine); and the step's
    embeddings, ``{request_id: vector}`` of the pooling requests whose prompt it completed
    (``worker.pooler``; set by the runner)."""

    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]
    errors: list[str | None]
    pooled: dict[str, list[float]] = field(default_factory=dict)


def _draw(logits: torch.Tensor, requests, params: list, rows: list[int], errors: list) -> dict[int, torch.Tensor]:
    """Seeded draws of the sampled ``rows``: ``{row: token tensor [1]}``; a row whose
    parameters leave no valid distribution, or whose draw raises, gets ``errors[row]``
    naming its parameters instead (the others are drawn as in a batch without it)."""
    def usable(p: torch.Tensor) -> list[bool]:  # [n, vocab] -> a distribution to draw from, per row
        return (torch.isfinite(p).all(-1) & (p.sum(-1) > 0)).tolist()

    try:
        batch = sampling_probs(logits, params, rows)  # [len(rows), vocab]
        probs, valid = list(batch), usable(batch)
    except Exception:  # noqa: BLE001 - one row's values broke the batched filter: redo row by row
        probs, valid = [], []
        for i in rows:
            try:
                p = sampling_probs(logits, params, [i])
                probs.append(p[0])
                valid.append(usable(p)[0])
            except Exception as e:  # noqa: BLE001 - this request fails alone
                probs.append(None)
                valid.append(False)
                errors[i] = (f"request {requests[i].request_id!r}: sampling with {params_text(params[i])} "
                             f"failed ({type(e).__name__}: {e})")
    draws = {}
    for ok, p, i in zip(valid, probs, rows, strict=True):
        if errors[i] is not None:
            continue
        if not ok:
            errors[i] = (f"request {requests[i].request_id!r}: {params_text(params[i])} left no token to "
                         f"sample (the filters masked every token or the probabilities are not finite)")
            continue
        try:
            draws[i] = torch.multinomial(p, 1, generator=requests[i].generator)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            errors[i] = (f"request {requests[i].request_id!r}: sampling with {params_text(params[i])} "
                         f"failed ({type(e).__name__}: {e})")
    return draws


def sample(logits: torch.Tensor, requests, grammar_bitmask: tuple[list[int], torch.Tensor] | None = None
           ) -> SamplerOutput:
    """Pick one token per row.

    Args:
        logits: ``[num_rows, vocab]`` fp32 logits, row ``i`` for ``requests[i]``.
        requests: objects with ``request_id``, ``sampling_params`` and ``generator``.
        grammar_bitmask: ``(rows, bitmask)``: the constrained rows and their int32 token
            bitmasks ``[len(rows), ceil(vocab / 32)]`` (from the ``StructuredOutputManager``);
            a token whose bit is 0 gets ``-inf`` in that row (one op for all of them; other
            rows untouched), and logprobs are those of the masked distribution (as vLLM's).
            A constrained row whose allowed tokens have no finite logit fails alone.
            Logit bias and penalties come after the mask; logprobs are taken before them
            (vLLM's default ``raw_logprobs``).

    Returns:
        ``SamplerOutput``; a row that cannot be sampled has token ``None`` and an error
        naming the request and the parameter at fault. Never raises for one row's values.
    """
    num_rows = logits.shape[0]
    # One pass for both: a row's max is NaN if it holds a NaN, +inf if it holds +inf, -inf if
    # it has no finite value; otherwise finite, and its index is the greedy token (first maximum).
    row_max, tokens = logits.max(dim=-1)  # [rows], [rows]; greedy rows keep tokens
    bad = ~torch.isfinite(row_max)  # [rows]
    bad_rows = bad.nonzero()[:, 0].tolist() if num_rows else []
    if bad_rows:
        logits = logits.masked_fill(bad[:, None], 0.0)
    dead_rows: list[int] = []
    if grammar_bitmask is not None and grammar_bitmask[0]:
        g_rows, g_mask = grammar_bitmask
        gidx = torch.tensor(g_rows, device=logits.device)
        masked = apply_token_bitmask(logits[gidx], g_mask)  # [n_constrained, vocab]
        g_max, g_tokens = masked.max(dim=-1)
        logits = logits.index_copy(0, gidx, masked)
        tokens = tokens.index_copy(0, gidx, g_tokens)
        dead = ~torch.isfinite(g_max)
        if bool(dead.any()):
            dead_rows = [g_rows[j] for j in dead.nonzero()[:, 0].tolist() if g_rows[j] not in bad_rows]
            logits[torch.tensor(dead_rows, dtype=torch.long, device=logits.device)] = 0.0
    pen_dead: list[int] = []
    raw = logits  # logprobs: before penalties (vLLM raw_logprobs)
    logits, pen_rows = apply_penalties(logits, requests)
    if pen_rows:  # greedy picks from the penalised logits
        pidx = torch.tensor(pen_rows, device=logits.device)
        p_max, p_tokens = logits[pidx].max(dim=-1)
        tokens = tokens.index_copy(0, pidx, p_tokens)
        done = set(bad_rows) | set(dead_rows)  # left: rows the penalties left without a token (-inf / NaN)
        pen_dead = [r for r, ok in zip(pen_rows, (p_max > float("-inf")).tolist(), strict=True)
                    if not ok and r not in done]
    params = [r.sampling_params for r in requests]
    errors: list[str | None] = [None] * num_rows
    for i in bad_rows:
        errors[i] = (f"request {requests[i].request_id!r}: the model's logits are not finite "
                     f"(NaN, +inf or no finite value); no token can be sampled")
    for i in dead_rows:
        errors[i] = (f"request {requests[i].request_id!r}: no token its grammar allows has a finite logit; "
                     f"no token can be sampled")
    for i in pen_dead:
        errors[i] = (f"request {requests[i].request_id!r}: no token has a finite logit after logit_bias and "
                     f"penalties; no token can be sampled")
    rows = [i for i, p in enumerate(params) if not is_greedy(p.temperature) and errors[i] is None]
    if rows:
        draws = _draw(logits, requests, params, rows, errors)
        if draws:
            idx = torch.tensor(list(draws), device=logits.device)
            tokens = tokens.index_copy(0, idx, torch.cat(list(draws.values())))
    asked = [i for i, p in enumerate(params) if p.logprobs is not None and errors[i] is None]
    try:
        logprobs, tops = request_logprobs(raw, tokens, requests, asked)
    except Exception:  # noqa: BLE001 - one row's logprobs broke the batch: redo row by row
        logprobs, tops = [None] * num_rows, [None] * num_rows
        for i in asked:
            try:
                lp, top = request_logprobs(raw, tokens, requests, [i])
                logprobs[i], tops[i] = lp[i], top[i]
            except Exception as e:  # noqa: BLE001 - this request fails alone
                errors[i] = (f"request {requests[i].request_id!r}: logprobs={params[i].logprobs!r} failed "
                             f"({type(e).__name__}: {e})")
    token_ids: list[int | None] = tokens.tolist()
    for i, err in enumerate(errors):
        if err is not None:
            token_ids[i], logprobs[i], tops[i] = None, None, None
    return SamplerOutput(token_ids, logprobs, tops, errors)
