"""Serving benchmark (issues 4 and 10) on SmolLM2-135M, in the bench dtype: many requests at once.

Requests: seeded random token-id prompts (lengths uniform in 16..512) and output lengths
(16..128), EOS ignored so each request produces exactly its ``max_tokens``. Systems:

(a) ours: all requests in one ``LLM.generate`` call (paged cache, chunked prefill);
(b) HF ``generate`` one request at a time;
(c) HF ``generate`` in left-padded batches of 16 (attention mask); a batch runs to its
    longest request, only each request's own first ``max_tokens`` tokens are counted;
(d) HF continuous batching (``init_continuous_batching`` manager, what ``generate_batch``
    uses, with per-request ``max_new_tokens`` through ``add_request``);
(e) llama.cpp on the same GGUF (``benchmarks.llamacpp``), one request after another (its
    Python binding has no batching); "not installed" when ``llama-cpp-python`` is absent.

HF runs in the bench dtype like ours.

Output tokens/s = sum of requested output tokens / wall seconds of the whole batch
(prefill included). Greedy tokens are compared with (b). Also: KV reserved but empty in our
cache after every engine step; decode FLOP/s at batch >= 32 against the measured GEMM peak;
and the VLM mix of ``benchmarks.vlm.mix``.
"""

from __future__ import annotations

import random

import torch

from benchmarks import llamacpp, vlm
from benchmarks.common import (compare_tokens, dtype_name, fmt, gemm_peak_flops, log, markdown_table, match_str,
                               nonembedding_params, now, random_prompts, section, text_model_paths)


def _ours(llm, prompts, outs) -> tuple[float, list[list[int]], list[dict]]:
    """Run (a); sample KV use after every step. Returns (seconds, token ids, per-step samples)."""
    from atlas_vlm import SamplingParams

    eng, samples = llm.engine, []
    bm, step = eng.block_manager, eng.step

    def sampled_step():
        res = step()
        live = sum(r.num_computed_tokens for r in eng.scheduler.running)
        samples.append({"reserved": (bm.num_blocks - bm.num_free_blocks) * bm.block_size, "live": live})
        return res

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    eng.step = sampled_step
    try:
        t0 = now()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = now() - t0
    finally:
        del eng.step
    return seconds, [r.token_ids for r in res], samples


def _hf_kwargs(n: int, pad: int) -> dict:
    return dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=pad)


@torch.inference_mode()
def _hf_sequential(model, prompts, outs, pad) -> tuple[float, list[list[int]]]:
    toks, t0 = [], now()
    for p, n in zip(prompts, outs):
        ids = torch.tensor([p])
        toks.append(model.generate(ids, attention_mask=torch.ones_like(ids), **_hf_kwargs(n, pad))[0, len(p):].tolist())
    return now() - t0, toks


@torch.inference_mode()
def _hf_padded(model, prompts, outs, pad, batch: int = 16) -> tuple[float, list[list[int]]]:
    toks, t0 = [], now()
    for s in range(0, len(prompts), batch):
        ps, ns = prompts[s:s + batch], outs[s:s + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        out = model.generate(ids, attention_mask=mask, **_hf_kwargs(max(ns), pad))
        toks += [out[i, width:width + n].tolist() for i, n in enumerate(ns)]
    return now() - t0, toks


def _hf_continuous(folder, prompts, outs, pad, timeout_s: float, dtype: torch.dtype) -> tuple[float, list[list[int]]]:
    """(d). transformers 5's continuous batching (``init_continuous_batching`` with a
    ``ContinuousBatchingConfig``, SDPA over its paged cache, no flash attention on CPU). It
    sizes its cache from CUDA memory when ``num_blocks`` / ``max_batch_tokens`` are not given,
    so both are given; on CPU we report 8 GiB "device memory" for the remaining sizing only."""
    import transformers.generation.continuous_batching.cache as cb_cache
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
    blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, outs)) + 64
    config = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=pad)
    cb_config = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=2048, page_size=16,
                                         auto_switch_to_flash=False, use_cuda_graph=False)
    original = cb_cache.get_device_and_memory_breakdown
    if not torch.cuda.is_available():
        cb_cache.get_device_and_memory_breakdown = lambda: (torch.device("cpu"), 8 << 30, 0, 0)
    try:
        def once(ps, ns):
            manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
            manager.start()
            results, t0 = {}, now()
            try:
                for i, (p, n) in enumerate(zip(ps, ns)):
                    manager.add_request(p, request_id=str(i), max_new_tokens=n)
                while len(results) < len(ps) and now() - t0 < timeout_s:
                    r = manager.get_result(timeout=1)
                    if r is not None and r.status.name == "FINISHED":
                        if r.error:
                            raise RuntimeError(f"request {r.request_id}: {r.error}")
                        results[r.request_id] = r.generated_tokens
                    elif r is None and not manager.is_running():
                        raise RuntimeError("the generation thread died (see the log above)")
                if len(results) < len(ps):
                    raise TimeoutError(f"{len(results)}/{len(ps)} requests finished in {timeout_s:.0f} s")
            finally:
                manager.stop(block=True, timeout=10)
            return now() - t0, [list(results[str(i)])[:n] for i, n in enumerate(ns)]

        once(prompts[:2], [4, 4])  # warm-up
        return once(prompts, outs)
    finally:
        cb_cache.get_device_and_memory_breakdown = original


def decode_flops(llm, batch: int, out_tokens: int, peak: float, seed: int = 1) -> dict:
    """Decode FLOP/s of our engine at ``batch`` running requests (64-token prompts).

    FLOPs of a pure-decode step (every chunk 1 token) = sum over its ``B`` tokens of
    ``2 * P + 2 * d * V + 4 * L * H * Dh * c`` (``P``: non-embedding parameters, ``d * V``:
    the LM head, ``L`` layers, ``H`` query heads of ``Dh`` channels, ``c``: the token's
    context length, QK^T and PV). Divided by the seconds of ``ModelRunner.run`` (forward +
    sampling) of those steps, and by whole ``engine.step`` seconds (scheduling included).
    """
    from atlas_vlm import SamplingParams

    eng, model = llm.engine, llm.engine.runner.model
    a = model.arch
    P = nonembedding_params(llm.engine.hf_config)
    per_tok = 2 * P + 2 * a.hidden_size * a.vocab_size
    attn = 4 * a.num_layers * a.num_heads * a.head_dim
    steps, run, step = [], eng.runner.run, eng.step

    def timed_run(chunks, **kwargs):  # kwargs: grammar_bitmask, passed through
        t0 = now()
        res = run(chunks, **kwargs)
        steps.append({"B": len(chunks), "decode": all(n == 1 for _, n in chunks), "run_s": now() - t0,
                      "flops": sum(per_tok + attn * r.num_computed_tokens + attn for r, _ in chunks)})
        return res

    def timed_step():
        t0 = now()
        res = step()
        if steps and "step_s" not in steps[-1]:
            steps[-1]["step_s"] = now() - t0
        return res

    eng.runner.run, eng.step = timed_run, timed_step
    try:
        prompts = random_prompts(batch, 64, 64, (100, len(llm.tokenizer)), seed)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        del eng.runner.run, eng.step
    dec = [s for s in steps if s["decode"] and s["B"] >= min(batch, 32)]
    flops = sum(s["flops"] for s in dec)
    run_s, step_s = sum(s["run_s"] for s in dec), sum(s["step_s"] for s in dec)
    return {"batch": batch, "steps": len(dec), "nonembedding_params": P, "flop_s_forward": flops / run_s,
            "flop_s_step": flops / step_s, "tok_s": sum(s["B"] for s in dec) / step_s,
            "frac_peak_forward": flops / run_s / peak, "frac_peak_step": flops / step_s / peak,
            "engine_overhead_pct": 100 * (1 - run_s / step_s)}


def run(quick: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Run the serving section, print its tables, return the results (seconds, ratios)."""
    from transformers import AutoModelForCausalLM

    from atlas_vlm import LLM

    num, plen, olen = (16, (16, 256), (8, 32)) if quick else (64, (16, 512), (16, 128))
    gguf, folder = text_model_paths()
    vocab = (100, 49152)  # SmolLM2's ids past its special tokens
    prompts = random_prompts(num, *plen, vocab, seed=0)
    outs = [random.Random(1000 + i).randint(*olen) for i in range(num)]
    blocks = sum(-(-(len(p) + n) // 16) for p, n in zip(prompts, outs)) + 512  # all fit: no preemption
    dname = dtype_name(dtype)
    llm = LLM(gguf, dtype=dname, max_model_len=1024, num_kvcache_blocks=blocks, max_num_seqs=64)
    total_out = sum(outs)
    section(f"Serving: {num} requests, prompts {plen[0]}..{plen[1]} (random ids, seed 0), outputs "
            f"{olen[0]}..{olen[1]} ({total_out} output tokens, greedy, ignore_eos), SmolLM2-135M {dname}")
    pad = llm.tokenizer.eos_token_id
    llm.generate(prompts[:2], None, use_tqdm=False)  # warm-up
    log("(a) ours")
    runs = {}
    t, toks, samples = _ours(llm, prompts, outs)
    runs["(a) ours, one generate call"] = {"seconds": t, "tokens": toks}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    _hf_sequential(hf, prompts[:1], [4], pad)  # warm-up
    log("(b) HF generate, one at a time")
    t, toks = _hf_sequential(hf, prompts, outs, pad)
    runs["(b) HF generate, 1 at a time"] = {"seconds": t, "tokens": toks}
    log("(c) HF generate, padded batches of 16")
    t, toks = _hf_padded(hf, prompts, outs, pad)
    runs["(c) HF generate, padded batches of 16"] = {"seconds": t, "tokens": toks}
    log("(d) HF continuous batching")
    try:
        t, toks = _hf_continuous(folder, prompts, outs, pad, timeout_s=300 if quick else 900, dtype=dtype)
        runs["(d) HF continuous batching"] = {"seconds": t, "tokens": toks}
    except Exception as e:  # noqa: BLE001 - a peer failing must not stop the benchmark
        print(f"  (d) HF continuous batching FAILED: {type(e).__name__}: {e}")
        runs["(d) HF continuous batching"] = {"error": f"{type(e).__name__}: {e}"}
    name = "(e) llama.cpp, 1 at a time (GGUF as stored)"
    why_not = llamacpp.available()
    if why_not is None:
        log(name)
        lcpp = llamacpp.load(gguf, n_ctx=1024, threads=torch.get_num_threads())
        llamacpp.stream(lcpp, prompts[0], 4)  # warm-up
        t, toks = llamacpp.sequential(lcpp, prompts, outs)
        runs[name] = {"seconds": t, "tokens": toks}
        del lcpp
    else:
        runs[name] = {"error": why_not}
    ref = runs["(b) HF generate, 1 at a time"]["tokens"]
    ours_tps = total_out / runs["(a) ours, one generate call"]["seconds"]
    rows = []
    for name, r in runs.items():
        if "error" in r:
            rows.append([name, "-", "-", "-", r["error"][:60] if name.startswith("(e)") else "failed: " + r["error"][:60]])
            continue
        r["tok_s"] = total_out / r["seconds"]
        r["match_vs_hf_sequential"] = compare_tokens(r.pop("tokens"), ref) if name[1] != "b" else None
        rows.append([name, fmt(ours_tps / r["tok_s"]), fmt(r["tok_s"], 1), fmt(r["seconds"], 1),
                     match_str(r["match_vs_hf_sequential"]) if r["match_vs_hf_sequential"] else "(reference)"])
    r = runs["(b) HF generate, 1 at a time"]
    r.pop("tokens")
    print("output tok/s = requested output tokens / wall seconds (prefill included)\n")
    print(markdown_table(["system", "ours / this (output tok/s)", "output tok/s", "wall s", "greedy = (b)"], rows))

    section("KV cache use over the run (ours, paged, sampled after every engine step)")
    res_sum, live_sum = sum(s["reserved"] for s in samples), sum(s["live"] for s in samples)
    peak = max(samples, key=lambda s: s["reserved"])
    kv = {"steps": len(samples), "reserved_empty_pct": 100 * (1 - live_sum / res_sum),
          "peak_reserved_tokens": peak["reserved"], "peak_live_tokens": peak["live"]}
    print(markdown_table(["engine steps", "reserved but empty (token-weighted mean)", "at peak reservation",
                          "peak reserved tokens"],
                         [[kv["steps"], f"{kv['reserved_empty_pct']:.1f}%",
                           f"{100 * (1 - peak['live'] / peak['reserved']):.1f}%", peak["reserved"]]]))
    print("\n(reserved = blocks held * block size; live = tokens whose K/V are computed; a prompt's "
          "blocks are reserved at admission, before chunked prefill fills them)")

    section("Decode FLOP/s of our engine vs the measured GEMM peak")
    peak_flops = gemm_peak_flops(dtype=dtype)
    log(f"{dname} matmul peak {peak_flops / 1e9:.1f} GFLOP/s (2048^3, best of 5)")
    flops = [decode_flops(llm, b, 8 if quick else 32, peak_flops) for b in ((32,) if quick else (32, 64))]
    print(markdown_table(["batch", "decode tok/s", "GFLOP/s (forward)", "of peak (forward)", "of peak (whole step)",
                          "engine overhead (step - forward)"],
                         [[f["batch"], fmt(f["tok_s"], 1), fmt(f["flop_s_forward"] / 1e9, 1),
                           f"{100 * f['frac_peak_forward']:.1f}%", f"{100 * f['frac_peak_step']:.1f}%",
                           f"{f['engine_overhead_pct']:.1f}%"] for f in flops]))
    print(f"\nFLOPs per decode token = 2*P + 2*d*V + 4*L*H*Dh*c (P = {flops[0]['nonembedding_params']:,} "
          f"non-embedding params, d*V = LM head, c = context length); peak = {peak_flops / 1e9:.1f} GFLOP/s")
    del llm, hf
    mix = vlm.mix(quick, dtype)
    return {"dtype": dname, "num_requests": num, "output_tokens": total_out, "systems": runs, "kv": kv,
            "gemm_peak_flop_s": peak_flops, "decode_flops": flops, "vlm_mix": mix}
