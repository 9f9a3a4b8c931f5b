"""Micro-benchmark of one decode step's attention: ``"decode_kernel"`` and ``"bucketed"`` vs ``"reference"``.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 30 layers, 16-token
blocks); ``--batch`` decode requests with context lengths drawn uniformly from
``--min-ctx .. --max-ctx`` (one token each), blocks scattered at random. One step costs the
metadata build (once) plus ``paged_attention`` in every layer (the layers share one cache
layer here: the data read per layer is the same). Prints the median step time of each
backend and their ratio; nothing is asserted. Run: ``python -m benchmarks.attention``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from atlas_vlm.kernels import decode_kernel
from atlas_vlm.layers.attention import build_attention_metadata, paged_attention
from mm_kv_cache_management import KVCacheSpec, PagedKVCache

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BS = 9, 3, 64, 30, 16


def decode_step(batch: int, min_ctx: int, max_ctx: int, seed: int = 0):
    """(query_lens, context_lens, slot_mapping, block_tables, num_blocks) of one decode step."""
    rng = random.Random(seed)
    c_lens = [rng.randint(min_ctx, max_ctx) for _ in range(batch)]
    need = sum(-(-c // BS) for c in c_lens)
    free = list(range(need))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // BS))] for c in c_lens]
    slots = [t[(c - 1) // BS] * BS + (c - 1) % BS for t, c in zip(tables, c_lens)]
    return [1] * batch, c_lens, slots, tables, need


def time_step(backend: str, step, cache, q, k, v, repeats: int) -> float:
    """Median seconds of one step (metadata + LAYERS attention calls)."""
    q_lens, c_lens, slots, tables, _ = step
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        meta = build_attention_metadata(q_lens, c_lens, slots, tables, backend=backend)
        for _ in range(LAYERS):
            paged_attention(q, k, v, cache, 0, meta, HEAD_DIM ** -0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first run warms up


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--min-ctx", type=int, default=64)
    p.add_argument("--max-ctx", type=int, default=1024)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    step = decode_step(args.batch, args.min_ctx, args.max_ctx)
    cache = PagedKVCache(KVCacheSpec(1, KV_HEADS, HEAD_DIM, dtype), step[4], BS)
    cache.k_cache.normal_()
    cache.v_cache.normal_()
    q = torch.randn(args.batch, HEADS, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(2, args.batch, KV_HEADS, HEAD_DIM, dtype=dtype)
    backends = ["reference", "bucketed"] + (["decode_kernel"] if decode_kernel.available() else [])
    with torch.inference_mode():
        times = {b: time_step(b, step, cache, q, k, v, args.repeats) for b in backends}
    print(f"decode step attention, batch {args.batch}, context {args.min_ctx}..{args.max_ctx} "
          f"(mean {statistics.mean(step[1]):.0f}), {args.dtype}, {LAYERS} layers, {torch.get_num_threads()} threads")
    print("  ".join(f"{b} {t * 1e3:.1f} ms ({times['reference'] / t:.2f}x)" for b, t in times.items()))
    if "decode_kernel" not in times:
        print("decode_kernel: not available (no C compiler?)")


if __name__ == "__main__":
    main()
