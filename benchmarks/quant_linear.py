"""Micro-benchmark of the quantized linear kernels on SmolLM2-135M's projection shapes, one
decode row (``python -m benchmarks.quant_linear [--rows 1] [--dtype bfloat16]``): dense
``F.linear`` vs ``torch.ops.aten._weight_int8pack_mm`` (per channel) vs
``_weight_int4pack_mm_for_cpu`` (groups of 32 / 64), microseconds per call, best of 3 runs of
``--iters`` calls. The numbers behind the kernel choice in ``atlas_vlm/layers/quant_linear.py``."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # (out, in): qkv, o, gate_up, down, head


def _time(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {args.rows} rows, {args.dtype}; us per call")
    print("| out x in | dense | int8 | int4 g32 | int4 g64 |\n|---|---|---|---|---|")
    for n, k in SHAPES:
        x = torch.randn(args.rows, k, dtype=dt)
        w = torch.randn(n, k, dtype=dt)
        q8 = torch.randint(-127, 127, (n, k), dtype=torch.int8)
        s8 = torch.rand(n, dtype=dt)
        q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        cells = [_time(lambda: F.linear(x, w), args.iters), _time(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8), args.iters)]
        for g in (32, 64):
            sz = torch.rand(k // g, n, 2, dtype=dt)
            cells.append(_time(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, g, sz), args.iters))
        print(f"| {n} x {k} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
