"""Pooling of embedding requests (``PoolingParams``) from one step's final hidden states.

A pooling request's chunks run in ordinary engine steps next to generation; the runner
hands this module the step's hidden states ``[num_tokens, hidden]`` (after the final norm).
"mean" pooling keeps each chunk's rows summed in the request's ``pooled_sum`` (fp32, the
pooler's running state) so that a prompt split over several steps (chunked prefill) gives
the same vector as one step; on the chunk that ends the prompt the vector is made: pooled,
truncated to ``dimensions``, then L2-normalised (vLLM's ``Pooler`` for the embed task: LAST /
MEAN, Matryoshka before normalize), and returned through the step's output
(``SamplerOutput.pooled``): the scheduler, the request's one writer, sets its ``embedding``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_step(chunks, hidden: torch.Tensor) -> dict[str, list[float]]:
    """Pool the step's pooling chunks into their requests.

    Args:
        chunks: ``[(request, num_tokens)]`` of the step, in the order of ``hidden``'s rows;
            each request computed tokens ``num_computed_tokens .. + num_tokens - 1``
            (``num_computed_tokens`` not yet moved on). Requests without
            ``pooling_params`` are skipped.
        hidden: ``[sum num_tokens, hidden]`` final hidden states of the step.

    Returns:
        ``{request_id: embedding}`` (a list of floats) for each request whose prompt ends in
        this step; "mean" requests keep their running sum in ``request.pooled_sum`` until then.
    """
    base, pooled = 0, {}
    for req, n in chunks:
        params = req.pooling_params
        if params is not None:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            rows = hidden[base:base + n].float()
            if params.pooling == "mean":
                total = rows.sum(dim=0)
                # a chunk from token 0 starts afresh (the first chunk, or a recompute after preemption)
                req.pooled_sum = total if start == 0 or req.pooled_sum is None else req.pooled_sum + total
            if end == req.num_tokens:
                vec = rows[-1] if params.pooling == "last" else req.pooled_sum / req.num_tokens
                pooled[req.request_id] = finish_vector(vec, params).tolist()
                req.pooled_sum = None
        base += n
    return pooled


def finish_vector(vec: torch.Tensor, params) -> torch.Tensor:
    """``vec`` ``[hidden]`` truncated to ``params.dimensions`` then L2-normalised if
    ``params.normalize`` (fp32)."""
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    return F.normalize(vec, dim=0) if params.normalize else vec
