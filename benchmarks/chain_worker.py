"""One system on one chain-size GGUF file, in its own process (so its peak RSS is its own):
``python -m benchmarks.chain_worker ours|llama.cpp FILE [--quick]`` prints one JSON line.

Measured (same ids for both systems, greedy, EOS ignored): one stream of ``N`` new tokens
(128; decode tok/s = (N - 1) / (last token time - first token time), warm-up once, best of
2), time to first token of one 512- and one 2,048-token prompt (best of 2), ``R`` mixed
requests (16 and 64: prompts of 32-512 ids, 16-128 new tokens; ours batched in one
``generate``, llama.cpp's binding one after another), and the process's peak RSS (bytes).
``--quick``: 32 new tokens, 512-token prefill only, 8 mixed requests. Ours also reports its KV
cache's bytes (``kv_bytes``), the part of its peak RSS the memory target adds to the file size.
"""

from __future__ import annotations

import json
import random
import resource
import sys

import torch

from benchmarks import llamacpp
from benchmarks.common import best_of, now, random_prompts
from benchmarks.text import _best, _ours

VOCAB = (100, 150000)  # ids drawn from the Qwen2.5 vocabulary


def mixed(num: int, seed: int = 3) -> tuple[list[list[int]], list[int]]:
    """``num`` prompts of 32-512 random ids and their new-token counts (16-128)."""
    rng = random.Random(seed)
    return random_prompts(num, 32, 512, VOCAB, seed), [rng.randint(16, 128) for _ in range(num)]


def measure(system: str, path: str, quick: bool) -> dict:
    """The figures above for ``system`` ("ours" or "llama.cpp") on the GGUF ``path``."""
    n, prefills, counts = (32, (512,), (8,)) if quick else (128, (512, 2048), (16, 64))
    ids = random_prompts(1, 24, 24, VOCAB, seed=1)[0]
    threads = torch.get_num_threads()
    out = {"system": system, "threads": threads}
    if system == "ours":
        from atlas_vlm import LLM, SamplingParams

        llm = LLM(path, quantization="gguf", max_model_len=2560, max_num_batched_tokens=2048,
                  num_kvcache_blocks=2048, enable_prefix_caching=False)
        out["kernel"] = llm.engine.runner.decode_step is not None
        out["kv_bytes"] = llm.engine.runner.kv_cache.nbytes
        stream = lambda: _ours(llm, ids, n)  # noqa: E731

        def first_token(p):
            llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)

        def batch(prompts, outs):
            params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in outs]
            t0 = now()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return now() - t0
    else:
        lcpp = llamacpp.load(path, n_ctx=2560, threads=threads)
        stream = lambda: llamacpp.stream(lcpp, ids, n)  # noqa: E731
        first_token = lambda p: llamacpp.stream(lcpp, p, 1)  # noqa: E731
        batch = lambda prompts, outs: llamacpp.sequential(lcpp, prompts, outs)[0]  # noqa: E731
    r = _best(stream, 2)
    out["decode_tok_s"], out["tokens"] = (n - 1) / r["decode_s"], r["tokens"]
    for T in prefills:
        p = random_prompts(1, T, T, VOCAB, seed=7)[0]
        out[f"ttft_{T}_s"] = best_of(lambda: first_token(p), 2)[0]
    for num in counts:
        prompts, outs = mixed(num)
        seconds = batch(prompts, outs)
        out[f"mixed_{num}_s"], out[f"mixed_{num}_tok_s"] = seconds, sum(outs) / seconds
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], "--quick" in sys.argv[3:])))
