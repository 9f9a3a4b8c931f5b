"""The cost of ``deterministic=True`` (batch-invariant mode, docs/deterministic.md) on the
embedded SmolLM2-135M: ``--batch`` requests of different prompt lengths (fixed ids, greedy,
``--tokens`` new tokens each, EOS ignored) through a default engine and a deterministic one,
rounds interleaved (a shared machine's load hits both alike), best round kept.
**Throughput = generated tokens / wall time of the whole ``generate`` call** (prefill
included). With ``--check-alone`` each request is also run alone on the deterministic
engine and the tokens compared (the mode's promise: all equal); the default engine's
together-vs-alone count is printed too. Nothing is asserted.
Run: ``python -m benchmarks.deterministic [--tile 16]``.
"""

from __future__ import annotations

import argparse
import os
import time

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.default_models import default_text_model
from atlas_vlm.layers import batch_invariant


def _run(llm, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.token_ids) for o in out]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tile", type=int, default=batch_invariant.ROW_TILE, help="rows per linear call")
    p.add_argument("--check-alone", action="store_true")
    args = p.parse_args(argv)
    batch_invariant.ROW_TILE = args.tile
    prompts = [{"prompt_token_ids": [1000 + 13 * i + j for j in range(20 + (i * 7) % 41)]} for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    kw = dict(dtype=args.dtype, max_model_len=256, num_kvcache_blocks=16 * args.batch, max_num_seqs=args.batch)
    engines = {"default": LLM(default_text_model(), **kw), "deterministic": LLM(default_text_model(), deterministic=True, **kw)}
    best, tokens = {k: float("inf") for k in engines}, {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            seconds, tokens[name] = _run(llm, prompts, params)
            best[name] = min(best[name], seconds)
    result = {name: args.batch * args.tokens / s for name, s in best.items()}
    print(f"load {os.getloadavg()[0]:.2f}; {args.batch} requests x {args.tokens} tokens, {args.dtype}, tile {args.tile}")
    for name, tok_s in result.items():
        print(f"{name:>14}: {tok_s:8.1f} tok/s (best of {args.rounds}: {best[name]:.2f} s)")
    result["ratio"] = result["deterministic"] / result["default"]
    print(f"deterministic / default: {result['ratio']:.3f}x")
    if args.check_alone:
        for name, llm in engines.items():
            alone = [_run(llm, [pr], params)[1][0] for pr in prompts]
            equal = sum(a == b for a, b in zip(alone, tokens[name]))
            result[f"{name}_equal_alone"] = equal
            print(f"{name:>14}: {equal} / {args.batch} requests give the tokens they give alone")
    return result


if __name__ == "__main__":
    main()
