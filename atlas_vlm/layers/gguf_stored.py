"""Layers on GGUF tensors as stored, beside ``GGUFLinear`` (the stored-block kernels: Q4_K,
Q5_K, Q6_K, Q8_0 with rows a multiple of 256 values):

- ``GGUFDequantLinear``: any other type ``gguf.quants.dequantize`` reads (Q4_0, Q4_1, Q5_0,
  Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, ..., and a kernel type whose rows are not whole
  super-blocks, as SmolLM2's 576): the same constructor as ``GGUFLinear``; ``forward``
  dequantizes the blocks on every call (correct, slow: about 20 ns a weight in numpy); the
  loader keeps such types as the plain ``nn.Linear`` of :meth:`GGUFDequantLinear.to_linear`
  (their dense size in memory, as before, and every dense fast path).
- ``GGUFFusedLinear``: one fused projection (q/k/v, gate/up) whose parts have different
  types (Q4_K_M's Q4_K q/k beside a Q6_K v): each part its own layer, outputs concatenated.
- ``GGUFEmbedding``: a quantized token table; a lookup dequantizes only the rows asked for.

:func:`stored_linear` picks the layer for a type. Values are ``gguf.quants.dequantize``'s
(exact), so a dequantized layer equals the dense copy of the same tensor bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from atlas_vlm.kernels.gguf_kernel import QK_K, TYPES
from atlas_vlm.layers.gguf_linear import GGUFLinear

__all__ = ["GGUFDequantLinear", "GGUFEmbedding", "GGUFFusedLinear", "dequantize_rows", "kernel_runs",
           "stored_linear"]


def dequantize_rows(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 ``[n, bytes per row]`` of GGUF type ``qtype`` -> fp32 ``[n, K]`` (``gguf.quants.dequantize``)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(blocks.contiguous().numpy(), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def kernel_runs(qtype: str, in_features: int) -> bool:
    """Whether ``GGUFLinear``'s kernel runs this type at this row length (whole 256-value super-blocks)."""
    return qtype in TYPES and in_features >= QK_K and in_features % QK_K == 0


class GGUFDequantLinear(nn.Module):
    """``y = x @ W^T (+ bias)``, ``W`` one GGUF tensor's blocks of any ``gguf``-readable type.

    Args: as ``GGUFLinear`` (``blocks`` uint8 ``[out_features, bytes per row]``, kept as given).

    Raises:
        ValueError: ``blocks`` is not uint8 ``[out_features, bytes per row of qtype]`` (named).
    """

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        want = (out_features, in_features // per_block * nbytes)
        if in_features % per_block or blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
            raise ValueError(f"GGUF {qtype} [{out_features}, {in_features}] needs uint8 blocks {list(want)} "
                             f"(rows of whole {per_block}-value blocks), got {blocks.dtype} {list(blocks.shape)}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def to_linear(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """The dense ``nn.Linear`` of these blocks (``dtype``; values ``gguf``'s dequantization):
        what the loader keeps for a type without a stored-block kernel, so the dense paths
        (oneDNN-packed bf16, batch-invariant) apply."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(dequantize_rows(self.blocks, self.qtype).to(dtype), requires_grad=False)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.to(dtype), requires_grad=False)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_rows(self.blocks, self.qtype)  # [N, K], every call
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), b)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


def stored_linear(blocks: torch.Tensor, qtype: str, in_features: int, out_features: int,
                  bias: torch.Tensor | None = None) -> nn.Module:
    """``GGUFLinear`` where its kernel runs ``qtype`` at ``in_features``, else ``GGUFDequantLinear``."""
    cls = GGUFLinear if kernel_runs(qtype, in_features) else GGUFDequantLinear
    return cls(blocks, qtype, in_features, out_features, bias)


class GGUFFusedLinear(nn.Module):
    """A fused projection whose parts are separate layers: ``y = cat([p(x) for p in parts], -1)``.

    Args:
        parts: the layers, in output-row order (q, k, v or gate, up), equal ``in_features``.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)  # [..., sum of parts' out_features]


class GGUFEmbedding(nn.Module):
    """A token table stored quantized: ``forward(ids)`` dequantizes the rows of ``ids`` only.

    Args:
        blocks: uint8 ``[vocab, bytes per row]`` (a view of the mapped file).
        qtype: its GGUF type name; embedding_dim: ``hidden``.
        dtype: the dtype of the returned rows.
    """

    def __init__(self, blocks: torch.Tensor, qtype: str, embedding_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.qtype, self.dtype = qtype, dtype
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[...]`` -> ``[..., hidden]``."""
        flat = ids.reshape(-1).cpu()
        rows = dequantize_rows(self.blocks.index_select(0, flat), self.qtype)  # [n, hidden]
        return rows.to(device=ids.device, dtype=self.dtype).view(*ids.shape, self.embedding_dim)
