"""Next-token choice for the rows of a step that finished a prompt or a decode."""

from __future__ import annotations

import torch


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (-inf) all but the ``top_k`` best and the smallest set with mass >= ``top_p``. ``[vocab]``."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cut = probs.cumsum(-1) - probs >= top_p  # tokens entirely past the nucleus
        logits = logits.masked_fill(torch.zeros_like(cut).scatter(0, order, cut), float("-inf"))
    return logits


def sample(logits: torch.Tensor, requests) -> tuple[list[int], list[float | None], list[dict[int, float] | None]]:
    """Pick one token per row.

    Args:
        logits: ``[num_rows, vocab]`` fp32 logits, row ``i`` for ``requests[i]``.
        requests: objects with ``sampling_params`` and ``generator`` (``torch.Generator``).

    Returns:
        token ids, the sampled tokens' logprobs (``None`` where not asked) and top-k
        ``{id: logprob}`` dicts (``None`` where not asked). Logprobs are of the raw model
        distribution, before temperature and filtering (as vLLM reports them).
    """
    greedy_ids = logits.argmax(dim=-1).tolist()
    tokens, logprobs, tops = [], [], []
    logp = None
    for row, req in enumerate(requests):
        params = req.sampling_params
        if params.greedy:
            token = greedy_ids[row]
        else:
            scaled = _filter_top_k_top_p(logits[row] / params.temperature, params.top_k, params.top_p)
            probs = scaled.softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=req.generator).item())
        tokens.append(token)
        if params.logprobs is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logp = logits[row].log_softmax(-1)
        logprobs.append(float(logp[token]))
        if params.logprobs > 0:
            values, ids = logp.topk(params.logprobs)
            tops.append(dict(zip(ids.tolist(), values.tolist())))
        else:
            tops.append({})
    return tokens, logprobs, tops
