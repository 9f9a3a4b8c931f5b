"""A linear layer on a GGUF tensor as stored: ``GGUFLinear`` holds the file's own bytes (a uint8
view of the reader's memory map, no copy, no conversion) and multiplies through
``kernels.gguf_kernel.gguf_matmul`` (Q4_K, Q5_K, Q6_K, Q8_0). Q4_K, Q6_K and Q8_0 rows are
interleaved 16 at a time once, at construction, into anonymous memory (``gguf_kernel.repack``:
the same quants and scales; Q4_K 148 bytes a row per 256 values, Q6_K 210 and Q8_0 272 as stored) and multiplied by
``gguf_matmul_packed``, the fast kernel; the file's bytes are then no longer read.

Not yet what ``quantization="gguf"`` loads (that still converts to ``Int4Linear`` /
``Int8Linear``; issue 34 item 4 switches it over): a building block and its test.
"""

from __future__ import annotations

import mmap
import warnings

import numpy as np
import torch
from torch import nn

from atlas_vlm.kernels.gguf_kernel import TYPES, gguf_matmul, gguf_matmul_packed, repack, row_bytes


class GGUFLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with ``W`` the stored blocks of one GGUF tensor.

    Args:
        blocks: uint8 ``[out_features, bytes per row]``, the file's bytes (kept as given: a
            view of the mapped file stays one).
        qtype: the GGUF type name (``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"``, ``"Q8_0"``).
        in_features, out_features: ``K`` (a multiple of 256) and ``N``.
        bias: fp32 ``[N]`` or None.

    Attributes:
        blocks: the stored bytes as given. packed: uint8, the rows interleaved for the fast
            kernel (``gguf_kernel.repack``), or None (another type, or no C kernel).

    Raises:
        ValueError: a type the kernel does not run, or ``blocks`` not ``[N, bytes per row]`` uint8.
    """

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        want = (out_features, row_bytes(qtype, in_features))
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
            raise ValueError(f"GGUFLinear {qtype} [{out_features}, {in_features}] needs uint8 blocks {list(want)}, "
                             f"got {blocks.dtype} {list(blocks.shape)}")
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("packed", repack(blocks, qtype, out_features, in_features), persistent=False)

    @classmethod
    def from_tensor(cls, tensor, bias: torch.Tensor | None = None) -> GGUFLinear:
        """The layer on ``tensor``, a ``gguf.GGUFReader`` tensor (2-D, ``shape`` ``[K, N]`` in
        GGUF order), its bytes viewed in place (``torch.from_numpy`` of the read-only map).

        Raises:
            ValueError: not a 2-D tensor of a type the kernel runs (named).
        """
        qtype = tensor.tensor_type.name
        if qtype not in TYPES or len(tensor.shape) != 2:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({qtype}, shape {list(tensor.shape)}) is not a 2-D "
                             f"tensor of {sorted(TYPES)}")
        k, n = int(tensor.shape[0]), int(tensor.shape[1])
        with warnings.catch_warnings():  # the map is read-only; the kernel only reads it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            blocks = torch.from_numpy(tensor.data).view(n, -1)  # [N, bytes per row], no copy
        layer = cls(blocks, qtype, k, n, bias)
        if layer.packed is not None:  # the interleaved copy is what runs: the file's pages can go
            drop_mapped_pages(tensor.data)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.packed is not None:  # the bias added in fp32, then one rounding to x's dtype
            y = gguf_matmul_packed(x2, self.packed, self.qtype, self.out_features, self.in_features,
                                   bias=self.bias)  # [M, N]
        else:
            y = gguf_matmul(x2, self.blocks, self.qtype, self.out_features, self.in_features)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


def drop_mapped_pages(arr: np.ndarray) -> bool:
    """``MADV_DONTNEED`` on the pages of ``arr`` where it lies in a file map (``np.memmap``, as
    ``gguf.GGUFReader`` gives), so bytes read once (to interleave them) stop counting in the
    resident set; a later read faults them back in from the file. Returns whether it did
    (False: not in a file map, or the OS lacks ``madvise``)."""
    base = arr
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    mm = getattr(base, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED") or arr.nbytes == 0:
        return False
    lo = arr.ctypes.data - np.frombuffer(mm, dtype=np.uint8).ctypes.data  # offset of arr in the map
    start, end = lo // mmap.PAGESIZE * mmap.PAGESIZE, min(lo + arr.nbytes, len(mm))
    if start < 0 or end <= start:
        return False
    mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    return True
