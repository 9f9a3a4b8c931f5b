"""The batch-invariant mode of ``EngineConfig.deterministic`` (docs/deterministic.md):
linears in fixed row tiles, attention row by row through the C decode kernel.

Why: a CPU GEMM library picks its kernel (and so the order of each output's reduction over
``in_features``) from the number of rows ``M``. Measured on this project's CPU (torch's MKL
and oneDNN, 2 threads): in fp32 ``F.linear`` gives other bits for a row at ``M = 1`` (a GEMV)
than at ``M = 2..3`` and again at ``M >= 4``; in bf16 (oneDNN, packed or not) ``M = 1``
differs from ``M >= 2`` for ``in_features = 1536`` (SmolLM2's down projection). So a
request's logits depended on how many other rows shared its step. Within one fixed ``M``
each row's bits were measured not to depend on its position or on the other rows.

How: every linear runs on exactly ``ROW_TILE`` rows per call: the input is cut into tiles of
``ROW_TILE`` rows, the last tile zero-padded, so the library always sees the same ``M`` and
a row's result never depends on the batch. This is the idea of vLLM's batch-invariant
matmul (one tile configuration whatever ``M``, "Defeating Nondeterminism in LLM
Inference", Thinking Machines, 2025) done over the library's own kernel. Attention: every
query row goes through the C decode kernel alone (``per_row_layout``), so a prefill row, a
chunk's row, a verification row and a decode row at one position get the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

# rows per GEMM call in deterministic mode (a step with fewer rows pays for 32). Measured on the
# embedded SmolLM2-135M in bf16 (benchmarks/deterministic.py, docs/deterministic.md): 16 cost
# 0.58x of the default mode's throughput at 64 requests and 0.75x at 1; 32: 0.88x and 0.45x;
# 64: 0.93x and 0.32x. 32 meets the 0.85x target at 64 requests.
ROW_TILE = 32


class RowTiledLinear(nn.Module):
    """A linear layer (``nn.Linear``, ``layers.linear.PackedLinear``) run on fixed
    ``tile``-row blocks: ``x`` ``[..., in_features]`` -> ``[..., out_features]``, each row's
    bits independent of how many rows ``x`` has.

    Args:
        inner: the layer; its forward must map ``[n, in_features]`` row-wise.
        tile: rows per call (``ROW_TILE``).

    Raises:
        ValueError: ``tile`` < 1.
    """

    def __init__(self, inner: nn.Module, tile: int = ROW_TILE):
        super().__init__()
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"tile must be an int >= 1 (rows), got {tile!r}")
        self.inner, self.tile = inner, tile
        self.in_features, self.out_features = inner.in_features, inner.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The inner layer's weight (a ``PackedLinear`` has none: AttributeError)."""
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])  # [n, in]
        n, t = rows.shape[0], self.tile
        pad = (-n) % t
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        out = torch.cat([self.inner(rows[i:i + t]) for i in range(0, n + pad, t)]) if n + pad > t \
            else self.inner(rows)
        return out[:n].reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"tile={self.tile}"


def tile_linears(module: nn.Module, tile: int | None = None) -> int:
    """Wrap every ``nn.Linear`` / ``PackedLinear`` under ``module`` in a ``RowTiledLinear``
    of ``tile`` rows (None: ``ROW_TILE`` as it is at the call) in place; call after
    ``pack_linears``. Returns the number wrapped."""
    from atlas_vlm.layers.linear import PackedLinear

    tile = ROW_TILE if tile is None else tile

    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Linear, PackedLinear)):
            setattr(module, name, RowTiledLinear(child, tile))
            count += 1
        elif not isinstance(child, RowTiledLinear):
            count += tile_linears(child, tile)
    return count


def deterministic_unsupported_reason(device: torch.device | str, quantized: bool, attention_backend: str,
                                     compile_decode) -> str | None:
    """Why ``deterministic=True`` cannot run with these settings (None: it can). Covered: dense
    weights on CPU with the C decode kernel (``kernels.decode_kernel``), eager steps.

    Args:
        device: the resolved device.
        quantized: the model has quantized linears (int8 / int4 / GGUF codes / AWQ / GPTQ).
        attention_backend: ``EngineConfig.attention_backend`` as asked.
        compile_decode: ``EngineConfig.compile_decode`` as asked.
    """
    if torch.device(device).type != "cpu":
        return f"it runs on CPU only (device {torch.device(device)})"
    if quantized:
        return "quantized linears (int8 / int4 / GGUF codes / AWQ / GPTQ) are not covered; load the model dense"
    if attention_backend not in ("auto", "decode_kernel"):
        return f"it attends through the C decode kernel; attention_backend={attention_backend!r} cannot be used"
    if compile_decode is True:
        return "the compiled decode step is not covered; leave compile_decode 'auto' or False"
    return None


def per_row_layout(query_lens: list[int], context_lens: list[int], tables: torch.Tensor,
                   device: torch.device | str = "cpu"):
    """The ``"batch_invariant"`` attention layout: every query row of the step (prefill,
    chunked prefill, speculative verification or decode) is one row of a
    ``attention_bucketed.DecodeBatch`` for the C decode kernel, attending keys
    ``0 .. its position`` of its request through the request's block table. The kernel
    reduces each (row, KV head) alone over the keys in order, so a row's bits are the same
    whatever its step holds and however its prompt was chunked (a prompt's last row gets the
    bits a one-row decode at that position would get).

    Args:
        query_lens / context_lens: per request, new tokens this step / tokens in cache after it.
        tables: ``[num_seqs, max_blocks]`` block ids (``attention_bucketed.block_table_tensor``).

    Returns:
        a ``BucketedLayout`` with only ``decode_batch`` set (``all_tokens=True``).
    """
    from atlas_vlm.layers.attention_bucketed import BucketedLayout, DecodeBatch

    seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))  # [num_tokens]
    lens = [c - q + 1 + i for q, c in zip(query_lens, context_lens) for i in range(q)]  # each row's context
    return BucketedLayout(decode_buckets=[], prefills=[], decode_batch=DecodeBatch(
        token_index=torch.arange(len(lens), device=device),
        block_tables=tables.index_select(0, seq.to(tables.device)).contiguous(),
        context_lens=torch.tensor(lens, dtype=torch.long, device=device), all_tokens=True))
