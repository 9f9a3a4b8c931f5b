"""The Triton kernels' tests (pytest marker ``triton``): on a machine without CUDA they run in
Triton's CPU interpreter on CPU tensors. ``TRITON_INTERPRET=1`` must be set before a kernel
module is imported (``@triton.jit`` reads it when it decorates), so it is set here, at
collection; ``atlas_vlm`` imports its Triton modules only when the ``"triton"`` backend is used.
On a CUDA machine the same tests run the compiled kernels on the GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
