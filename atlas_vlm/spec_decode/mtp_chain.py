"""The MTP drafter's chained steps (draft 2..k): attention over the paged cache + local K/V.

Draft ``i + 1`` of a request runs the MTP layer once more at position ``L - 1 + i`` (``L``:
the request's positions whose MTP K/V the step wrote for real), on its own previous output
hidden state and draft ``i``. Its keys are the request's MTP K/V at positions ``0 .. L - 1``
(paged cache, layer ``kv_layer``) and those of its chained steps so far, which stay local
(``ChainKV``): positions past the step's reserved slots have no slot to write to, and they are
recomputed for real once the target has verified them. Reference backend layout, one query
row per request.
"""

from __future__ import annotations

import torch

from atlas_vlm.layers.attention import AttentionMetadata


class ChainKV:
    """A KV-cache view for the chained MTP steps: ``write`` keeps the step's K/V locally,
    ``gather_kv_for_attention`` returns the paged context (``real_lens`` positions per
    request, padded to the longest) followed by every local K/V written so far.

    Args:
        kv_cache: the engine's paged / contiguous cache.
        block_tables: ``[num_seqs, max_blocks]`` the drafting requests' block tables.
        real_lens: per request, positions whose MTP K/V are in ``kv_cache``.
    """

    def __init__(self, kv_cache, block_tables: torch.Tensor, real_lens: list[int]):
        self.kv_cache, self.block_tables, self.real_lens = kv_cache, block_tables, real_lens
        self.max_real = max(real_lens)
        self.keys: list[torch.Tensor] = []  # each [num_seqs, kv_heads, head_dim]
        self.values: list[torch.Tensor] = []
        self._context = None  # (layer, k, v) of the paged part, gathered once

    def write(self, layer: int, slot_mapping, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one chained step's ``k`` / ``v`` ``[num_seqs, kv_heads, head_dim]``."""
        self.keys.append(k)
        self.values.append(v)

    def gather_kv_for_attention(self, layer: int, block_tables, max_len: int):
        """``k, v``: ``[num_seqs, max_real + chained, kv_heads, head_dim]`` (``chain_metadata``
        masks the padding between a request's own context and the chained keys)."""
        if self._context is None or self._context[0] != layer:
            k, v = self.kv_cache.gather_kv_for_attention(layer, self.block_tables, self.max_real)
            self._context = (layer, k, v)
        _, k, v = self._context
        k = torch.cat([k.to(self.keys[0].dtype), torch.stack(self.keys, dim=1)], dim=1)
        v = torch.cat([v.to(self.values[0].dtype), torch.stack(self.values, dim=1)], dim=1)
        return k, v


def chain_metadata(chain: ChainKV, step: int, device) -> AttentionMetadata:
    """The layout of chained step ``step`` (1-based: keys = paged context + ``step`` local
    ones): one query row per request, attending its own ``real_lens`` positions and every
    chained key. Reference backend (a dense mask)."""
    n = len(chain.real_lens)
    width = chain.max_real + step
    keys = torch.arange(width, device=device)
    real = torch.tensor(chain.real_lens, device=device)
    mask = (keys[None, :] < real[:, None]) | (keys[None, :] >= chain.max_real)  # [num_seqs, width]
    rows = torch.arange(n, device=device)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long, device=device),  # unused: ChainKV keeps its K/V
        block_tables=chain.block_tables,
        context_lens=[r + step for r in chain.real_lens],
        query_lens=[1] * n,
        query_index=rows[:, None],  # [num_seqs, 1]
        token_index=rows,
        attn_mask=mask[:, None, None, :],  # [num_seqs, 1, 1, width]
    )
