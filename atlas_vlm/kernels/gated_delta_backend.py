"""Which kernels run a Gated DeltaNet layer's gated delta rule (``GatedDeltaNet.rule_backend``):
Triton (``triton_gated_delta`` for decode rows, ``triton_gated_delta_chunk`` for prefill) on
CUDA, else the C decode kernel (``gated_delta``) / PyTorch, as before. Apart from both so that
neither imports the other and ``triton`` is imported only when it may serve.
"""

from __future__ import annotations

import torch

RULE_BACKENDS = ("auto", "triton", "torch")  # GatedDeltaNet.rule_backend


def use_triton(requested: str, device: torch.device | str, dtype: torch.dtype, head_k_dim: int, head_v_dim: int,
               triton_step: bool = False) -> bool:
    """Whether a Gated DeltaNet layer runs its rule through Triton (``triton_gated_delta``,
    ``triton_gated_delta_chunk``) rather than the C decode kernel (``gated_delta``) / PyTorch.

    ``requested``: ``"auto"``: on CUDA (or in a step whose attention runs the ``"triton"``
    backend, ``triton_step``) where Triton imports and serves; ``"triton"``: always (CPU
    tensors need ``TRITON_INTERPRET=1``); ``"torch"``: never.

    Raises:
        ValueError: ``requested`` unknown, or ``"triton"`` where it cannot serve (the reason).
    """
    if requested not in RULE_BACKENDS:
        raise ValueError(f"rule_backend must be one of {RULE_BACKENDS}, got {requested!r}")
    if requested == "torch" or (requested == "auto" and torch.device(device).type != "cuda" and not triton_step):
        return False
    try:
        from atlas_vlm.kernels import triton_gated_delta
        why = triton_gated_delta.unsupported_reason(device, dtype, head_k_dim, head_v_dim)
    except ImportError as e:  # no triton (or a broken one): C / PyTorch serve
        why = f"triton does not import ({e})"
    if why is not None and requested == "triton":
        raise ValueError(f"rule_backend='triton' cannot serve this Gated DeltaNet layer: {why}")
    return why is None
