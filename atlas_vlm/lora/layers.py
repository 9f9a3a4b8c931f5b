"""LoRA over any linear module: the base layer's output plus the low-rank products of each
row's adapter, applied per group of rows with the same adapter (punica's shrink / expand,
vLLM's ``vllm/lora/layers`` and ``vllm/lora/punica_wrapper``).

Scope: ``PunicaBatch`` (one step's rows grouped by adapter slot, shared by every wrapped
layer: the step's metadata, set once per step) and ``LoRALinear`` (a wrapper around any
module with ``x [n, in] -> [n, out]``: ``nn.Linear``, the packed bf16 linear, int8 / int4
and GGUF linears alike, since the delta is added to the base output). A fused projection
(``qkv_proj``, ``gate_up_proj``) holds one A per HF projection stacked
(``[slots, n_sub * max_rank, in]``: one shrink) and one B per HF projection
(``[slots, out_j, max_rank]``) expanded into its own slice of the output (vLLM's
``QKVParallelLinearWithLoRA`` / ``MergedColumnParallelLinearWithLoRA``). Ranks below
``max_rank`` are zero-padded: the padded columns add exact zeros.
"""

from __future__ import annotations

import torch
from torch import nn


#: from this many adapters in one step, every wrapped layer runs one shrink over all slots
#: and masks each row to its own slot (vLLM's bgmv idea) instead of a gather per group
ALL_SLOTS_MIN_GROUPS = 3


class PunicaBatch:
    """One step's rows grouped by adapter slot: ``groups`` is ``[(slot, rows)]``, ``rows`` a
    ``[n]`` int64 index of the step's token rows with that slot, or None when every row of
    the step has it (the whole batch, no gather). Rows with slot -1 (no adapter) are in no group.
    With ``ALL_SLOTS_MIN_GROUPS`` adapters or more, ``mask`` is ``[n, max_loras]`` (1 at each
    row's slot, 0 elsewhere and for rows without one), else None."""

    def __init__(self, max_loras: int = 1) -> None:
        self.max_loras = max_loras
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.mask: torch.Tensor | None = None

    def set(self, token_slots: list[int], device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> None:
        """Group this step's rows by slot (``token_slots``: one slot per token row, -1: none)."""
        present = sorted(set(token_slots))
        self.mask = None
        if present == [-1] or not present:
            self.groups = []
        elif len(present) == 1:
            self.groups = [(present[0], None)]
        else:
            t = torch.tensor(token_slots, dtype=torch.long)
            self.groups = [(s, (t == s).nonzero().squeeze(1).to(device)) for s in present if s >= 0]
            if len(self.groups) >= ALL_SLOTS_MIN_GROUPS:
                mask = torch.zeros(len(token_slots), self.max_loras + 1, dtype=dtype)
                mask[torch.arange(len(token_slots)), t] = 1  # slot -1: the extra last column, dropped
                self.mask = mask[:, :self.max_loras].to(device)  # [n, max_loras]

    def clear(self) -> None:
        """No adapter for any row (steps run without LoRA until the next ``set``)."""
        self.groups, self.mask = [], None


class LoRALinear(nn.Module):
    """``base_layer(x)`` plus, for each group of rows with adapter slot ``s``,
    ``(x[rows] @ lora_a[s]^T)`` (shrink) expanded by each projection's ``lora_b[j][s]^T`` into
    its output slice (expand; the scaling folded into B at load), added in place.

    Args:
        base_layer: the wrapped module (``in_features`` / ``out_features`` attributes).
        sub_sizes: output rows of each HF projection fused into this one, in order
            (``[q, k, v]`` for ``qkv_proj``; one entry for an unfused projection).
        max_loras, max_rank: slots and padded rank.
        punica: the step's ``PunicaBatch`` (shared by every wrapped layer).

    Raises:
        ValueError: ``sub_sizes`` do not sum to the base layer's ``out_features``.
    """

    def __init__(self, base_layer: nn.Module, sub_sizes: list[int], max_loras: int, max_rank: int,
                 punica: PunicaBatch, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base_layer, self.punica, self.max_rank = base_layer, punica, max_rank
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        if sum(sub_sizes) != self.out_features:
            raise ValueError(f"LoRALinear: sub sizes {sub_sizes} do not sum to out_features {self.out_features}")
        self.sub_sizes = list(sub_sizes)
        n = len(sub_sizes)
        self.lora_a = torch.zeros(max_loras, n * max_rank, self.in_features, dtype=dtype, device=device)
        # B stored transposed, [slots, max_rank, out_j]: expand is h @ b[slot], and over all slots one GEMM
        self.lora_b = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for size in sub_sizes]

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Write one adapter into ``slot``: ``pairs[j]`` is projection ``j``'s ``(A [r, in],
        B [out_j, r])`` or None (not targeted: zeros); B is stored times ``scaling``."""
        self.lora_a[slot].zero_()
        for j, pair in enumerate(pairs):
            self.lora_b[j][slot].zero_()
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.lora_a[slot, j * self.max_rank:j * self.max_rank + r].copy_(a)
            self.lora_b[j][slot, :r].copy_(b.to(torch.float32).T * scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)  # [num_tokens, out]
        groups = self.punica.groups
        if not groups:
            return y
        if self.punica.mask is not None:
            return self._all_slots(x, y, self.punica.mask)
        r, off = self.max_rank, 0
        for slot, rows in groups:
            xs = x if rows is None else x.index_select(0, rows)  # [n, in]
            h = xs @ self.lora_a[slot].T  # shrink: [n, n_sub * max_rank]
            off = 0
            for j, b in enumerate(self.lora_b):
                size = self.sub_sizes[j]
                delta = h[:, j * r:(j + 1) * r] @ b[slot]  # expand: [n, out_j]
                if rows is None:
                    y[:, off:off + size] += delta
                else:
                    y[:, off:off + size].index_add_(0, rows, delta)
                off += size
        return y

    def _all_slots(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Many adapters in the step: one shrink over every slot, each row's other slots zeroed
        by ``mask`` (exact zeros), one expand per projection over every slot."""
        slots, r, n = mask.shape[1], self.max_rank, x.shape[0]
        h = (x @ self.lora_a.view(-1, self.in_features).T).view(n, slots, -1)  # [n, slots, n_sub * max_rank]
        h = h * mask[:, :, None]  # each row keeps its own slot's columns
        off = 0
        for j, b in enumerate(self.lora_b):
            hj = h[:, :, j * r:(j + 1) * r].reshape(n, slots * r)  # [n, slots * max_rank]
            y[:, off:off + self.sub_sizes[j]] += hj @ b.view(slots * r, -1)  # [n, out_j]
            off += self.sub_sizes[j]
        return y

    def extra_repr(self) -> str:
        return f"sub_sizes={self.sub_sizes}, slots={self.lora_a.shape[0]}, max_rank={self.max_rank}"
