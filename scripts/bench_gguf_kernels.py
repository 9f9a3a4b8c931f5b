"""Per-matmul times of the GGUF kernels on a real file's shapes, one script, one run: the
16-row interleaved kernel (``gguf_matmul_packed``, what ``GGUFLinear`` runs), the stored-row
kernel (``gguf_matmul``) and the converted int4 / int8 path (``Int4Linear`` / ``Int8Linear``,
what ``quantization="gguf"`` loaded before), at M activation rows, with ratios; then a decode
estimate: the per-layer matmul times summed over the layers plus the LM head. Those weights
sit in the cache between calls (a 1.5B model's layer fits this machine's L3); ``--step``
also times every matmul of the model in a decode step's order, the weights streaming from
memory as in a real decode (needs the packed and the converted copies of every tensor).

    python scripts/bench_gguf_kernels.py FILE.gguf [--threads 2] [--rows 1 4] [--reps 20] [--step]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from gguf import GGUFReader

from atlas_vlm.kernels.gguf_kernel import gguf_matmul, gguf_matmul_packed, repack
from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear
from atlas_vlm.quantization.gguf_types import DECODERS, HAS_MIN, INT4_TYPES, group_of, int8_form

ROLES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def converted(rows, qtype: str, n: int, k: int):
    """The int4 / int8 module the converting loader makes of one tensor (kernel on)."""
    if qtype in INT4_TYPES:
        mod = Int4Linear(k, n, False, group_size=32)
        q, *scales = DECODERS[qtype](rows)
    else:
        mod = Int8Linear(k, n, group_size=group_of(qtype), has_min=qtype in HAS_MIN)
        q, *scales = int8_form(qtype, rows, mod.group_size, mod.has_min)
    mod.load_rows(0, q, *scales)
    mod.finalize(True)
    return mod


def stored(t, n: int) -> torch.Tensor:
    """The tensor's bytes in the map, ``[N, bytes per row]`` uint8, no copy."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(t.data.view("uint8").reshape(n, -1))


def whole_step(reader, rows: list[int], reps: int) -> None:
    """Every matmul of the model in a decode step's order (layers, then the LM head), each path
    over all its own copies: weights from memory, not the cache."""
    mats = []
    for t in reader.tensors:
        if t.name.endswith(".weight") and (t.name.startswith("blk.") and t.name.split(".")[2] in ROLES
                                            or t.name == "output.weight"):
            qtype, k, n = t.tensor_type.name, int(t.shape[0]), int(t.shape[1])
            blocks = stored(t, n)
            mats.append((qtype, k, n, blocks, repack(blocks, qtype, n, k), converted(blocks.numpy(), qtype, n, k)))
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {k for _, k, *_ in mats}}
        paths = [lambda: [gguf_matmul_packed(xs[k], p, q, n, k) for q, k, n, b, p, c in mats],
                 lambda: [gguf_matmul(xs[k], b, q, n, k) for q, k, n, b, p, c in mats],
                 lambda: [c(xs[k]) for q, k, n, b, p, c in mats]]
        tn, ts, ti = timed(paths, reps)
        print(f"whole step, M={m}, {len(mats)} matmuls from memory: new {tn * 1e3:.1f} ms ({m / tn:.1f} tok/s), "
              f"stored {ts * 1e3:.1f} ms, int4/8 {ti * 1e3:.1f} ms; new/stored {tn / ts:.2f}, new/int {tn / ti:.2f}")


def prefill(reader, names: list[str], m: int, reps: int) -> None:
    """``m``-row matmuls (a prompt's prefill): the interleaved kernel against the converted
    int4 / int8 path and ``F.linear`` on the weight dequantized beforehand (fp32), the
    reference's GEMM without its per-call dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}
    for name in names:
        t = by_name[name]
        qtype, k, n = t.tensor_type.name, int(t.shape[0]), int(t.shape[1])
        blocks = stored(t, n)
        packed, conv = repack(blocks, qtype, n, k), converted(blocks.numpy(), qtype, n, k)
        w = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType[qtype]))  # [N, K] fp32
        x = torch.randn(m, k)
        tn, ti, tf = timed([lambda: gguf_matmul_packed(x, packed, qtype, n, k), lambda: conv(x),
                            lambda: torch.nn.functional.linear(x, w)], reps)
        print(f"prefill {name:24s} {qtype} M={m}: new {tn * 1e3:.1f} ms, int4/8 {ti * 1e3:.1f} ms, fp32 dense "
              f"{tf * 1e3:.1f} ms; new/int {tn / ti:.2f}, new/dense {tn / tf:.2f}")


def timed(fns: list, reps: int) -> list[float]:
    """Fastest seconds of each of ``fns`` over ``reps`` rounds (one call of each a round, after
    a warm-up round): on a shared machine the minimum is the kernel, the rest other load."""
    best = [float("inf")] * len(fns)
    for r in range(reps + 1):
        for j, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            if r:
                best[j] = min(best[j], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 1], help="layers to time (types differ by layer)")
    ap.add_argument("--step", action="store_true", help="also time a whole decode step's matmuls from memory")
    ap.add_argument("--prefill", type=int, default=0, help="also time layer 0's matmuls at this many rows")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    reader = GGUFReader(a.gguf)
    by_name = {t.name: t for t in reader.tensors}
    n_layers = 1 + max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
    names = [f"blk.{i}.{r}.weight" for i in a.layers for r in ROLES] + ["output.weight"]
    totals = {m: [0.0, 0.0, 0.0] for m in a.rows}
    print(f"threads {a.threads}; times in ms (fastest of {a.reps} rounds); ratio = new / old")
    print(f"{'tensor':24s} {'type':5s} {'N x K':>13s} {'M':>2s} {'new':>8s} {'stored':>8s} {'int4/8':>8s} "
          f"{'new/stored':>10s} {'new/int':>8s}")
    for name in names:
        t = by_name[name]
        qtype, k, n = t.tensor_type.name, int(t.shape[0]), int(t.shape[1])
        blocks = stored(t, n)
        packed, conv = repack(blocks, qtype, n, k), converted(blocks.numpy(), qtype, n, k)
        for m in a.rows:
            x = torch.randn(m, k)
            reps = max(3, a.reps // 10) if n > 100_000 else a.reps
            tn, ts, ti = timed([lambda: gguf_matmul_packed(x, packed, qtype, n, k),
                                lambda: gguf_matmul(x, blocks, qtype, n, k), lambda: conv(x)], reps)
            weight = (n_layers / len(a.layers)) if name.startswith("blk.") else 1.0
            for j, v in enumerate((tn, ts, ti)):
                totals[m][j] += v * weight
            print(f"{name:24s} {qtype:5s} {n:6d}x{k:<6d} {m:2d} {tn * 1e3:8.3f} {ts * 1e3:8.3f} {ti * 1e3:8.3f} "
                  f"{tn / ts:10.2f} {tn / ti:8.2f}")
    for m, (tn, ts, ti) in totals.items():
        print(f"M={m}: all matmuls of one step (layers scaled to {n_layers}, + LM head): new {tn * 1e3:.1f} ms "
              f"({m / tn:.1f} tok/s), stored {ts * 1e3:.1f} ms ({m / ts:.1f}), int4/8 {ti * 1e3:.1f} ms "
              f"({m / ti:.1f}); new/stored {tn / ts:.2f}, new/int {tn / ti:.2f}")
    if a.prefill:
        prefill(reader, [f"blk.0.{r}.weight" for r in ROLES], a.prefill, max(2, a.reps // 10))
    if a.step:
        whole_step(reader, a.rows, max(2, a.reps // 5))


if __name__ == "__main__":
    main()
