"""Compiled vs eager decode step, and paged vs contiguous, on the embedded SmolLM2-135M (issue 19).

Four engines in one process on the same weights: eager paged, eager contiguous, compiled
paged (``compile_decode=True``), compiled contiguous. Each decodes one ~60-token prompt of
fixed ids (``--tokens`` greedy new tokens, EOS ignored), then ``--batch`` such prompts
together; rounds interleave the engines (so a shared machine's load hits them alike) and the
best round is kept. **Decode tok/s = rows x (N - 1) / (time of the last token - time of the
first token)**. The start-up cost is the first (compiling) call of each bucket's graph
(``CompiledDecode.compile_seconds``), cold the first time on a machine and shorter once
inductor's on-disk cache holds the kernels. Greedy tokens of compiled vs eager are compared
and printed; nothing is asserted. Run: ``python -m benchmarks.compiled_decode``.
"""

from __future__ import annotations

import argparse
import time

import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.default_models import default_text_model


def _decode(llm, batch: int, n: int) -> tuple[float, list[list[int]]]:
    prompts = [{"prompt_token_ids": [1000 + 13 * i + j for j in range(60)]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    times, tokens = [], {}
    for out in llm.generate(prompts, params, stream=True, use_tqdm=False):
        times.append(time.perf_counter())
        tokens[out.request_id] = out.token_ids
    # with streaming, one output per request per step: the first step's outputs end at index batch-1
    first, last = times[batch - 1], times[-1]
    return batch * (n - 1) / (last - first), [list(t) for t in tokens.values()]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {}
    for kind, blocks in (("paged", 256), ("contiguous", args.batch)):
        for compiled in (False, True):
            engines[(kind, compiled)] = LLM(default_text_model(), dtype=args.dtype, kv_cache=kind, max_model_len=2048,
                                            num_kvcache_blocks=blocks, max_num_seqs=args.batch,
                                            num_threads=args.threads, compile_decode=compiled)
    results = {}
    for batch in (1, args.batch):
        tok_s = {k: [] for k in engines}
        tokens = {}
        for k, llm in engines.items():  # warm-up: compiles bucket `batch` for the compiled engines
            start = time.perf_counter()
            _, tokens[k] = _decode(llm, batch, args.tokens)
            if k[1]:
                cd = llm.engine.runner.compiled_decode
                print(f"{k[0]:10s} compiled batch {batch}: first call {time.perf_counter() - start:.1f} s, "
                      f"compile per bucket {({b: round(s, 1) for b, s in cd.compile_seconds.items()})}, "
                      f"failed: {cd.failed}")
        for _ in range(args.rounds):
            for k, llm in engines.items():
                tok_s[k].append(_decode(llm, batch, args.tokens)[0])
        for (kind, compiled), v in tok_s.items():
            same = tokens[(kind, compiled)] == tokens[(kind, False)]
            results[(kind, compiled, batch)] = max(v)
            print(f"batch {batch:2d} {kind:10s} {'compiled' if compiled else 'eager   '}: decode tok/s best "
                  f"{max(v):6.1f} (rounds {', '.join(f'{x:.1f}' for x in v)}); tokens = eager: {same}")
    return results


if __name__ == "__main__":
    main()
