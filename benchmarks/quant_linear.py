"""Micro-benchmark of the quantized linear kernels on SmolLM2-135M's projection shapes
(``python -m benchmarks.quant_linear [--rows 1] [--dtype bfloat16] [--sweep]``): microseconds
per call, best of 3 runs of ``--iters`` calls, in the threads torch has. The numbers behind
the kernel choice in ``atlas_vlm/kernels/quant_kernel.py``:

- dense ``F.linear`` in ``--dtype`` (the unquantized layer);
- library peers: ``torch.ops.aten._weight_int8pack_mm`` (int8, one scale per row),
  ``_weight_int4pack_mm_for_cpu`` (int4 groups of 32; bf16 only: unvectorised in fp32, and
  its layout is AVX-512's), fbgemm's dynamic int8 linear (``torch.ao`` ``quantize_dynamic``,
  per-row int8, activations quantized per call; deprecated in torch, int8 only);
- ours (``quant_kernel.quant_matmul``): int8 in Q8_0's groups of 32, int4 groups of 32 and 64,
  with the GB/s of weight bytes it reads.

``--sweep``: ours against the dequantized weight + dense ``F.linear`` (the prefill path) at
1..128 rows, the measurement behind ``quant_linear.KERNEL_MAX_ROWS``.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # (out, in): qkv, o, gate_up, down, head


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def _ours(n: int, k: int, kind: str, group: int):
    from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear

    lin = torch.nn.Linear(k, n, bias=False)
    m = (Int4Linear if kind == "int4" else Int8Linear).from_float(lin, group)
    m.finalize(True)
    return m


def _fbgemm(n: int, k: int):
    lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(lin, {torch.nn.Linear}, dtype=torch.qint8)


def table(rows: int, dt: torch.dtype, iters: int) -> None:
    from atlas_vlm.layers.quant_linear import quant_kernel

    print(f"{torch.get_num_threads()} threads, {rows} rows, {dt}, our kernel {quant_kernel.isa()}; us per call "
          f"(GB/s of weight bytes read)")
    print("| out x in | dense | aten int8 (per row) | aten int4 g32 | fbgemm dyn int8 (fp32 in) | ours int8 g32 "
          "| ours int4 g32 | ours int4 g64 |\n|---|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        it = max(3, iters // 20) if n > 10000 else iters
        x = torch.randn(rows, k, dtype=dt)
        w = torch.randn(n, k, dtype=dt)
        q8 = torch.randint(-127, 127, (n, k), dtype=torch.int8)
        s8 = torch.rand(n, dtype=dt)
        cells = [_time(lambda: F.linear(x, w), it), _time(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8), it)]
        if dt == torch.bfloat16:
            q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
            sz = torch.rand(k // 32, n, 2, dtype=dt)
            cells.append(_time(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, 32, sz), it))
        else:
            cells.append(float("nan"))
        fb, xf = _fbgemm(n, k), x.float()
        cells.append(_time(lambda: fb(xf), it))
        text = [f"{c:.1f}" for c in cells]
        for kind, g in (("int8", 32), ("int4", 32), ("int4", 64)):
            m = _ours(n, k, kind, g)
            us = _time(lambda: m(x), it)
            text.append(f"{us:.1f} ({m.weight_bytes() / us / 1e3:.1f})")
        print(f"| {n} x {k} | " + " | ".join(text) + " |")


def sweep(dt: torch.dtype, iters: int) -> None:
    from atlas_vlm.kernels import quant_kernel
    from atlas_vlm.layers.quant_linear import dense_workspace

    print(f"\n{torch.get_num_threads()} threads, {dt}: int4 g64, us per call: our kernel / dequantized weight + "
          f"dense F.linear")
    row_counts = (1, 2, 4, 8, 16, 32, 48, 64, 128)
    print("| out x in | " + " | ".join(str(r) for r in row_counts) + " |\n|---|" + "---|" * len(row_counts))
    for n, k in SHAPES[:4]:
        m = _ours(n, k, "int4", 64)
        cells = []
        for r in row_counts:
            x = torch.randn(r, k, dtype=dt)
            a = _time(lambda: quant_kernel.quant_matmul(x, m.qweight, m.scales, m.mins, n, 64), iters)
            b = _time(lambda: F.linear(x, quant_kernel.dequantize(m.qweight, m.scales, m.mins, n, k, 64, dt,
                                                                  out=dense_workspace(n, k, dt))), iters)
            cells.append(f"{a:.0f} / {b:.0f}")
        print(f"| {n} x {k} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--sweep", action="store_true", help="also: ours vs dequantized + dense at 1..128 rows")
    args = p.parse_args(argv)
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)
    table(args.rows, dt, args.iters)
    if args.sweep:
        sweep(dt, max(5, args.iters // 10))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
