"""Micro-benchmark of the GGUF stored-block kernel (``python -m benchmarks.gguf_matmul
[--rows 1] [--out 1536] [--in 1536] [--iters 200]``): a Q4_K weight (random blocks) multiplied
as stored (``gguf_kernel.gguf_matmul``) against the same weight converted the way
``quantization="gguf"`` loads it today (``Int4Linear``, group 32, ``quant_kernel``), in the
threads torch has; microseconds per call (best of 5 runs) and the GB/s of each layout's weight
bytes (0.5625 bytes a weight as stored, 0.75 converted). A shared machine makes these rough.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from atlas_vlm.kernels import gguf_kernel, quant_kernel
from atlas_vlm.layers.quant_linear import Int4Linear
from atlas_vlm.quantization.gguf_types import DECODERS


def _time(fn, iters: int) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def q4_k_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k / 256 * 144]: random Q4_K blocks with fp16 d, dmin in [1e-3, 2e-3]."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    b[..., 0:4] = rng.uniform(1e-3, 2e-3, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--out", type=int, default=1536)
    ap.add_argument("--in", dest="in_features", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    n, k = a.out, a.in_features
    blocks = q4_k_blocks(n, k)
    conv = Int4Linear(k, n, False, group_size=32)
    conv.load_rows(0, *DECODERS["Q4_K"](blocks.numpy()))
    x = torch.randn(a.rows, k)
    y0, y1 = gguf_kernel.gguf_matmul(x, blocks, "Q4_K", n, k), conv(x)
    rel = float((y0 - y1).abs().max() / y1.abs().max())
    print(f"Q4_K [{n}, {k}] x {a.rows} rows, {torch.get_num_threads()} threads, gguf kernel {gguf_kernel.isa()}, "
          f"int4 kernel {quant_kernel.isa()}; max |diff| / max |y| between them {rel:.1e}")
    for name, fn, nbytes in [
        ("as stored (gguf_matmul)", lambda: gguf_kernel.gguf_matmul(x, blocks, "Q4_K", n, k), blocks.numel()),
        ("converted (Int4Linear)", lambda: quant_kernel.quant_matmul(x, conv.qweight, conv.scales, conv._mins(), n, 32),
         sum(t.numel() * t.element_size() for t in (conv.qweight, conv.scales, conv.mins))),
    ]:
        s = _time(fn, a.iters)
        print(f"  {name:26s} {s * 1e6:8.1f} us  {nbytes / 1e6:6.2f} MB  {nbytes / s / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
