"""Sampling's tensor ops, shared by the sampler (``worker.sampler``) and the speculative
verifier (``spec_decode.rejection``): top-k / top-p masking, the sampling distribution of a
row after temperature and filters, the raw-distribution logprobs vLLM reports, and the
parameters' text an error names. Pure functions of tensors and ``SamplingParams``; nothing
here draws a token or touches a request's state.
"""

from __future__ import annotations

import torch

__all__ = ["filter_top_k_top_p", "params_text", "request_logprobs", "sampling_probs"]


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) in each row all but its ``top_k`` best and the smallest set with mass
    >= ``top_p`` (HF ``TopKLogitsWarper`` then ``TopPLogitsWarper`` order).

    Args:
        logits: ``[rows, vocab]`` (temperature already applied).
        top_k: ``[rows]`` int; values <= 0 or >= vocab keep everything.
        top_p: ``[rows]`` float in (0, 1]; 1 keeps everything.
    """
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    if bool((k < vocab).any()):
        sorted_logits = logits.sort(dim=-1, descending=True).values  # [rows, vocab]
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [rows, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    use_p = top_p < 1.0
    if bool(use_p.any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        cut = (probs.cumsum(-1) - probs >= top_p[:, None]) & use_p[:, None]  # entirely past the nucleus
        logits = logits.masked_fill(torch.zeros_like(cut).scatter(1, order, cut), float("-inf"))
    return logits


def request_logprobs(logits: torch.Tensor, tokens: torch.Tensor, requests, rows: list[int]):
    """Raw-distribution logprobs (before temperature and filters, as vLLM reports them) of
    ``tokens`` ``[num_rows]`` at ``rows`` of ``logits`` ``[num_rows, vocab]``: per request, its
    token's logprob and its ``sampling_params.logprobs`` best ``{token id: logprob}`` (None for
    rows not asked)."""
    logprobs: list[float | None] = [None] * len(requests)
    tops: list[dict[int, float] | None] = [None] * len(requests)
    if not rows:
        return logprobs, tops
    idx = torch.tensor(rows, device=logits.device)
    logp = logits[idx].log_softmax(-1)  # [n_asked, vocab]
    chosen = logp.gather(1, tokens[idx][:, None])[:, 0].tolist()
    ks = [requests[r].sampling_params.logprobs for r in rows]
    values, ids = logp.topk(max(ks), dim=-1) if max(ks) > 0 else (None, None)
    values_l, ids_l = (values.tolist(), ids.tolist()) if values is not None else (None, None)
    for j, (r, k) in enumerate(zip(rows, ks, strict=True)):
        logprobs[r] = chosen[j]
        tops[r] = dict(zip(ids_l[j][:k], values_l[j][:k], strict=True)) if k > 0 else {}
    return logprobs, tops


def params_text(p) -> str:
    """``p``'s temperature, top-k, top-p (and min-p where set) as an error message names them."""
    text = f"temperature={p.temperature!r}, top_k={p.top_k!r}, top_p={p.top_p!r}"
    return text + (f", min_p={p.min_p!r}" if p.min_p else "")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) in each row the tokens whose probability is below ``min_p`` times the
    row's highest (HF ``MinPLogitsWarper``; the best token is always kept).

    Args:
        logits: ``[rows, vocab]`` (temperature, top-k and top-p already applied).
        min_p: ``[rows]`` float in [0, 1]; 0 keeps everything.
    """
    if not bool((min_p > 0).any()):
        return logits
    probs = logits.softmax(-1)  # [rows, vocab]
    remove = probs < min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(remove, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list, rows: list[int]) -> torch.Tensor:
    """``[len(rows), vocab]`` probabilities of ``rows`` after temperature, top-k, top-p and min-p."""
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    temps = torch.tensor([params[i].temperature for i in rows], dtype=logits.dtype, device=dev)
    top_k = torch.tensor([params[i].top_k for i in rows], device=dev)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=logits.dtype, device=dev)
    min_p = torch.tensor([params[i].min_p for i in rows], dtype=logits.dtype, device=dev)
    return apply_min_p(filter_top_k_top_p(logits[idx] / temps[:, None], top_k, top_p), min_p).softmax(-1)
