"""Text benchmark (issues 2 and 10) on SmolLM2-135M-Instruct, one request, in the bench dtype.

1. Decode speed: one ~60-token chat prompt, ``N`` greedy new tokens (EOS ignored, so every
   run produces exactly ``N``), our engine with the paged cache and with the contiguous cache
   against HF ``generate`` on the same weights (the GGUF converted to an HF folder), both in
   the bench dtype, and llama.cpp on the GGUF itself (``benchmarks.llamacpp``). Warm-up
   once, best of ``repeats``. **Decode tokens/s = (N - 1) / (time of the last token - time of
   the first token)** for every system (first-token times: our stream API; HF: a streamer).
   Beside it the bandwidth limit of batch-1 decode: measured read bandwidth (bytes/s) /
   weight bytes read per token (``common.decode_weight_bytes``).
2. Prefill: one 2,048-token prompt of random ids, time to the first token (one output
   token), ours (one 2,048-token chunk) vs HF vs llama.cpp; prefill FLOP/s against the
   measured GEMM peak of the dtype, FLOPs = ``2 * P * T + 2 * L * H * Dh * T * (T + 1)``
   (causal QK^T and PV) ``+ 2 * d * V`` (one logits row).
3. KV memory: 32 seeded prompt lengths in 16..1024 plus 64 output tokens each. Paged: blocks
   held in the real ``BlockManager`` after ``prefill_allocate`` and 64 ``decode_append``;
   contiguous: one ``max_model_len`` (2048) strip per request. Bytes per token are read off
   the engines' KV tensors (``kv_cache.nbytes``).
"""

from __future__ import annotations

import random

import torch

from benchmarks import llamacpp
from benchmarks.common import (best_of, compare_tokens, decode_weight_bytes, dtype_name, fmt, gemm_peak_flops, log,
                               markdown_table, match_str, nonembedding_params, now, random_prompts, read_bandwidth,
                               section, text_model_paths)

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather and how the keeper feels.")


class _Clock:
    """HF streamer that records the wall time (seconds) of every ``put``: the first put is the
    prompt, each later one a generated token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(now())

    def end(self) -> None:
        pass


def _ours(llm, ids: list[int], n: int) -> dict:
    """One streamed request. Returns seconds: total, to first token, and the token ids."""
    from atlas_vlm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0, first, last = now(), None, None
    for out in llm.generate({"prompt_token_ids": ids}, params, stream=True, use_tqdm=False):
        if first is None and out.token_ids:
            first = now()
        last = out
    end = now()
    return {"total_s": end - t0, "ttft_s": first - t0, "decode_s": end - first, "tokens": list(last.token_ids)}


def _hf(model, ids: list[int], n: int, pad_id: int) -> dict:
    """One HF ``generate`` call (greedy, exactly ``n`` new tokens). Same fields as ``_ours``."""
    clock = _Clock()
    inp = torch.tensor([ids])
    t0 = now()
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                             streamer=clock)
    end = now()
    first = clock.times[1]
    return {"total_s": end - t0, "ttft_s": first - t0, "decode_s": end - first, "tokens": out[0, len(ids):].tolist()}


def _best(fn, repeats: int) -> dict:
    """Warm up once, then keep the run with the shortest decode time."""
    fn()
    return min((fn() for _ in range(repeats)), key=lambda r: r["decode_s"])


def kv_memory(bytes_per_token: int, block_size: int, max_model_len: int = 2048, num: int = 32,
              out_tokens: int = 64, seed: int = 0) -> dict:
    """Reserved vs live KV bytes for ``num`` requests (lengths seeded in 16..1024, + ``out_tokens``).

    Returns:
        per layout ("paged", "contiguous"): reserved bytes, live bytes, waste % (1 - live/reserved).
    """
    from mm_kv_cache_management import BlockManager, RequestState

    rng = random.Random(seed)
    lens = [rng.randint(16, 1024) for _ in range(num)]
    bm = BlockManager(sum(-(-(n + out_tokens) // block_size) for n in lens), block_size)
    reserved_tokens = live_tokens = 0
    for i, n in enumerate(lens):
        req = RequestState(request_id=str(i), token_ids=[rng.randrange(1000, 40000) for _ in range(n)])
        bm.prefill_allocate(req)
        req.block_table.num_tokens = n
        for _ in range(out_tokens):
            req.token_ids.append(0)
            bm.decode_append(req)
        reserved_tokens += len(req.block_table.block_ids) * block_size
        live_tokens += req.block_table.num_tokens
    res = {"prompt_lens": lens, "out_tokens": out_tokens, "bytes_per_token": bytes_per_token}
    for kind, reserved in (("paged", reserved_tokens), ("contiguous", num * max_model_len)):
        res[kind] = {"reserved_bytes": reserved * bytes_per_token, "live_bytes": live_tokens * bytes_per_token,
                     "waste_pct": 100 * (1 - live_tokens / reserved)}
    return res


def prefill_flops(arch, params: int, tokens: int) -> int:
    """FLOPs of one causal prefill of ``tokens`` tokens that ends in one logits row (see 2. above)."""
    attn = 2 * arch.num_layers * arch.num_heads * arch.head_dim * tokens * (tokens + 1)
    return 2 * params * tokens + attn + 2 * arch.hidden_size * arch.vocab_size


def _prefill(quick: bool, dtype: torch.dtype, gguf: str, hf, threads: int, lcpp) -> dict:
    """Section 2: TTFT of one ``T``-token prompt, ours / HF / llama.cpp. Returns seconds and FLOP/s."""
    from atlas_vlm import LLM, SamplingParams

    T, repeats = (512, 2) if quick else (2048, 3)
    llm = LLM(gguf, dtype=dtype_name(dtype), max_model_len=T + 16, max_num_batched_tokens=T,
              num_kvcache_blocks=T // 16 + 8, enable_prefix_caching=False)
    ids = random_prompts(1, T, T, (100, 49152), seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    model = llm.engine.runner.model
    P = nonembedding_params(llm.engine.hf_config)
    flops = prefill_flops(model.arch, P, T)
    peak = gemm_peak_flops(dtype=dtype)
    res = {"tokens": T, "flops": flops, "gemm_peak_flop_s": peak, "systems": {}}

    def hf_once():
        inp = torch.tensor([ids])
        with torch.inference_mode():
            hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=1, do_sample=False, temperature=None,
                        top_p=None, top_k=None, pad_token_id=0)

    systems = [("ours", lambda: llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)),
               ("HF generate", hf_once)]
    if lcpp is not None:
        systems.append(("llama.cpp", lambda: llamacpp.stream(lcpp, ids, 1)))
    for name, fn in systems:
        log(f"prefill {T} tokens: {name}")
        seconds, _ = best_of(fn, repeats)
        res["systems"][name] = {"seconds": seconds, "tok_s": T / seconds, "flop_s": flops / seconds,
                                "frac_peak": flops / seconds / peak}
    return res


def run(quick: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Run the text section, print its tables, return the results (times in seconds)."""
    from transformers import AutoModelForCausalLM

    from atlas_vlm import LLM

    n, repeats = (32, 2) if quick else (128, 3)
    dname = dtype_name(dtype)
    threads = torch.get_num_threads()
    section(f"Text decode: SmolLM2-135M {dname}, 1 request, {n} new tokens, best of {repeats} ({threads} threads)")
    gguf, folder = text_model_paths()
    paged = LLM(gguf, dtype=dname, kv_cache="paged", max_model_len=2048, num_kvcache_blocks=256)
    contig = LLM(gguf, dtype=dname, kv_cache="contiguous", max_model_len=2048, num_kvcache_blocks=2)
    tok = paged.tokenizer
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    why_not = llamacpp.available()
    lcpp = llamacpp.load(gguf, n_ctx=4096, threads=threads) if why_not is None else None
    results = {}
    systems = [("ours paged", lambda: _ours(paged, ids, n)), ("ours contiguous", lambda: _ours(contig, ids, n)),
               ("HF generate", lambda: _hf(hf, ids, n, tok.eos_token_id))]
    if lcpp is not None:
        systems.append(("llama.cpp (GGUF as stored)", lambda: llamacpp.stream(lcpp, ids, n)))
    for name, fn in systems:
        log(f"decode: {name}")
        results[name] = _best(fn, repeats)
    ref = results["HF generate"]
    weight_bytes = decode_weight_bytes(paged.engine.hf_config, dtype)
    bandwidth = read_bandwidth()
    limit = bandwidth / weight_bytes
    rows = []
    for name, r in results.items():
        r["decode_tok_s"] = (n - 1) / r["decode_s"]
        r["total_tok_s"] = n / r["total_s"]
    for name, r in results.items():
        cmp = compare_tokens([r["tokens"]], [ref["tokens"]])
        r["match_hf"] = cmp
        frac = f"{100 * r['decode_tok_s'] / limit:.0f}%" if name.startswith(("ours", "HF")) else "-"
        rows.append([name, fmt(r["decode_tok_s"] / ref["decode_tok_s"]), fmt(r["decode_tok_s"], 1), frac,
                     fmt(r["total_tok_s"], 1), fmt(1000 * r["ttft_s"], 1), match_str(cmp)])
    if lcpp is None:
        rows.append(["llama.cpp", "-", "-", "-", "-", "-", why_not])
    print(f"prompt {len(ids)} tokens; decode tok/s = (N-1) / (last token time - first token time); bandwidth limit "
          f"= {bandwidth / 1e9:.1f} GB/s read / {weight_bytes / 1e6:.0f} MB of {dname} weights per token = "
          f"{limit:.1f} tok/s\n")
    print(markdown_table(["system", "decode tok/s vs HF", "decode tok/s", "of bandwidth limit", "total tok/s",
                          "TTFT ms", "greedy = HF"], rows))

    section(f"Prefill: one {512 if quick else 2048}-token prompt (random ids), time to first token, {dname}")
    pre = _prefill(quick, dtype, gguf, hf, threads, lcpp)
    base = pre["systems"]["HF generate"]["tok_s"]
    rows = [[name, fmt(r["tok_s"] / base), fmt(r["tok_s"], 0), fmt(1000 * r["seconds"], 0),
             f"{100 * r['frac_peak']:.0f}%"] for name, r in pre["systems"].items()]
    if lcpp is None:
        rows.append(["llama.cpp", "-", "-", "-", why_not])
    print(f"FLOPs {pre['flops'] / 1e9:.1f} G; {dname} GEMM peak {pre['gemm_peak_flop_s'] / 1e9:.1f} GFLOP/s "
          f"(2048^3 matmul, best of 5); llama.cpp's FLOPs are on quantized weights (same count)\n")
    print(markdown_table(["system", "prefill tok/s vs HF", "prefill tok/s", "TTFT ms", "of GEMM peak"], rows))

    section("KV memory: 32 requests, prompt lengths 16..1024 (seed 0) + 64 output tokens")
    bpt = paged.engine.runner.kv_cache.nbytes // (paged.engine.block_manager.num_blocks * paged.engine.block_manager.block_size)
    strip = contig.engine.runner.kv_cache.nbytes // contig.engine.block_manager.num_blocks
    mem = kv_memory(bpt, paged.engine.block_manager.block_size, max_model_len=2048)
    mem["contiguous_strip_bytes"] = strip
    rows = [[kind, f"{mem[kind]['reserved_bytes'] / 2**20:.1f}", f"{mem[kind]['live_bytes'] / 2**20:.1f}",
             f"{mem[kind]['waste_pct']:.1f}%"] for kind in ("paged", "contiguous")]
    rows[1][0] += " (max_model_len 2048 per request)"
    rows[0][0] += f" (block {paged.engine.block_manager.block_size})"
    print(f"{bpt} bytes/token (K+V, all layers); contiguous strip {strip / 2**20:.1f} MiB; "
          f"paged reserves {mem['contiguous']['reserved_bytes'] / mem['paged']['reserved_bytes']:.1f}x less\n")
    print(markdown_table(["layout", "reserved MiB", "live MiB", "waste"], rows))
    for r in results.values():
        r.pop("tokens")
    return {"dtype": dname, "decode_new_tokens": n, "prompt_tokens": len(ids), "decode": results,
            "llama_cpp": why_not or "ran", "read_bandwidth_bytes_s": bandwidth, "decode_weight_bytes": weight_bytes,
            "bandwidth_limit_tok_s": limit, "prefill": pre, "kv_memory": mem}
