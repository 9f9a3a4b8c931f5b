"""Micro-benchmark of one linear layer: ``F.linear`` vs ``PackedLinear`` (oneDNN-packed weight).

SmolLM2-135M's shapes (``[out, in]``: fused QKV, O, fused gate/up, down, LM head), bf16,
``--rows`` input rows (1: one decode token; 32: a decode batch; 2048: a prefill chunk). Prints
the median microseconds per call, the weight bytes read per microsecond (GB/s) and the
speed-up; nothing is asserted. Run: ``python -m benchmarks.linear``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from atlas_vlm.layers.linear import PackedLinear, can_pack
from benchmarks.common import markdown_table

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def median_us(fn, repeats: int) -> float:
    """Median microseconds of ``fn()`` over ``repeats`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 2048])
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    if not can_pack(torch.bfloat16, "cpu"):
        raise SystemExit("this torch has no oneDNN bf16 linear: nothing to compare")
    rows = []
    with torch.inference_mode():
        for rows_in in args.rows:
            for name, (n_out, n_in) in SHAPES.items():
                lin = nn.Linear(n_in, n_out, bias=False).to(torch.bfloat16)
                packed = PackedLinear(lin)
                x = torch.randn(rows_in, n_in).to(torch.bfloat16)
                plain_us = median_us(lambda: F.linear(x, lin.weight), args.repeats)  # noqa: B023 - called here
                packed_us = median_us(lambda: packed(x), args.repeats)  # noqa: B023
                gb = lin.weight.nbytes / 1e3
                rows.append([rows_in, name, f"{n_out}x{n_in}", f"{plain_us:.0f}", f"{packed_us:.0f}",
                             f"{gb / plain_us:.1f}", f"{gb / packed_us:.1f}", f"{plain_us / packed_us:.2f}x"])
    print(f"bf16 linear, {torch.get_num_threads()} threads, median of {args.repeats}\n")
    print(markdown_table(["rows", "layer", "weight", "F.linear us", "packed us", "F.linear GB/s", "packed GB/s",
                          "speed-up"], rows))


if __name__ == "__main__":
    main()
