"""Quantized decode (issue 19) on SmolLM2-135M-Instruct, one request: dense (fp32 and the
bench dtype) against the embedded Q4_1 GGUF as stored (``quantization="gguf"``) and int8 /
int4 quantized at load (round to nearest) from its dense conversion. Same prompt and
method as ``benchmarks.text`` (decode tok/s = (N - 1) / (last token time - first token
time), warm-up once, best of ``repeats``); beside each, the bandwidth limit computed from
the weight bytes one decode token really reads (the decoder's projections and norms as held,
plus the LM head; one embedding row is left out), and llama.cpp on the same GGUF when it is
installed.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks import llamacpp
from benchmarks.common import (best_of, compare_tokens, dtype_name, fmt, log, markdown_table, match_str, random_prompts,
                               read_bandwidth, section, text_model_paths)
from benchmarks.text import PROMPT, _best, _ours


def read_bytes_per_token(model) -> int:
    """Bytes one batch-1 decode token reads: every tensor of the decoder layers and the final
    norm as held (quantized weights, scales, zeros), plus the LM head (a packed bf16 one as
    ``in * out * 2``)."""
    from atlas_vlm.layers.linear import PackedLinear

    seen, total = set(), 0
    for part in (model.model.layers, model.model.norm):
        for t in list(part.parameters()) + list(part.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        total += sum(m.in_features * m.out_features * 2 for m in part.modules() if isinstance(m, PackedLinear))
    head = model.lm_head
    if hasattr(head, "weight_bytes"):
        total += head.weight_bytes()
    elif isinstance(head, nn.Linear):
        total += head.weight.numel() * head.weight.element_size()
    else:  # PackedLinear: a bf16 weight in oneDNN's layout
        total += head.in_features * head.out_features * 2
    return total


def run(quick: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Run the section, print its table, return the results (seconds, bytes, tok/s)."""
    from atlas_vlm import LLM
    from atlas_vlm.layers.quant_linear import quant_kernel_available

    n, repeats = (32, 2) if quick else (128, 3)
    dname = dtype_name(dtype)
    threads = torch.get_num_threads()
    kernel = quant_kernel_available("cpu")
    section(f"Quantized decode: SmolLM2-135M, 1 request, {n} new tokens, best of {repeats} ({threads} threads; "
            f"quantized kernels {'on' if kernel else 'off (no native bf16: dequantized reference)'})")
    gguf, _folder = text_model_paths()
    configs = [("dense fp32", dict(dtype="float32"))]
    if dname != "float32":
        configs.append((f"dense {dname}", dict(dtype=dname)))
    configs += [(f"GGUF Q4_1 as stored, {dname}", dict(dtype=dname, quantization="gguf")),
                (f"int8 at load, {dname}", dict(dtype=dname, quantization="int8")),
                (f"int4 at load (group 64), {dname}", dict(dtype=dname, quantization="int4"))]
    if dname != "float32":
        configs.append(("GGUF Q4_1 as stored, fp32", dict(dtype="float32", quantization="gguf")))
    bandwidth = read_bandwidth()
    results, ids = {}, None
    for name, kwargs in configs:
        log(f"quantized decode: {name}")
        llm = LLM(gguf, kv_cache="paged", max_model_len=2048, num_kvcache_blocks=256, **kwargs)
        if ids is None:
            ids = list(llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                         add_generation_prompt=True, tokenize=True,
                                                         return_dict=False))
        r = _best(lambda: _ours(llm, ids, n), repeats)
        r["decode_tok_s"] = (n - 1) / r["decode_s"]
        r["read_bytes"] = read_bytes_per_token(llm.engine.runner.model)
        r["limit_tok_s"] = bandwidth / r["read_bytes"]
        results[name] = r
        del llm
    why_not = llamacpp.available()
    if why_not is None:
        lcpp = llamacpp.load(gguf, n_ctx=4096, threads=threads)
        r = _best(lambda: llamacpp.stream(lcpp, ids, n), repeats)
        r["decode_tok_s"] = (n - 1) / r["decode_s"]
        results["llama.cpp (GGUF as stored)"] = r
    prefill = _prefill(gguf, dname, quick)
    plan = _plan_int4()
    base = results["dense fp32"]
    lc = results.get("llama.cpp (GGUF as stored)")
    rows = []
    for name, r in results.items():
        cmp = compare_tokens([r["tokens"]], [base["tokens"]])
        rows.append([name, fmt(r["decode_tok_s"], 1), fmt(r["decode_tok_s"] / base["decode_tok_s"]),
                     fmt(r["decode_tok_s"] / lc["decode_tok_s"]) if lc else "-",
                     f"{r['read_bytes'] / 1e6:.0f}" if "read_bytes" in r else "-",
                     f"{100 * r['decode_tok_s'] / r['limit_tok_s']:.0f}%" if "limit_tok_s" in r else "-",
                     match_str(cmp)])
    if lc is None:
        rows.append(["llama.cpp", "-", "-", "-", "-", "-", why_not])
    print(f"prompt {len(ids)} tokens; read bandwidth {bandwidth / 1e9:.1f} GB/s; limit = bandwidth / bytes read "
          f"per token\n")
    print(markdown_table(["system", "decode tok/s", "vs dense fp32", "vs llama.cpp", "MB read / token",
                          "of bandwidth limit", "greedy = dense fp32"], rows))
    print(f"\nPrefill: one {prefill['tokens']}-token prompt of random ids, time to first token, best of "
          f"{prefill['repeats']}, {dname}\n")
    dense_s = prefill["systems"][f"dense {dname}"]
    print(markdown_table(["system", "TTFT ms", "prefill tok/s", "dense TTFT / this"],
                         [[name, fmt(1e3 * sec, 1), fmt(prefill["tokens"] / sec, 0), fmt(dense_s / sec)]
                          for name, sec in prefill["systems"].items()]))
    print(f"\nPlanner ({plan['model']}, int4, {plan['gpu_memory_gib']} GiB, L={plan['max_model_len']}, one image at "
          f"{plan['max_pixels']} pixels): {plan['sequences']} sequences, {plan['weights_gib']:.2f} GiB of weights")
    for r in results.values():
        r.pop("tokens")
    return {"dtype": dname, "decode_new_tokens": n, "kernels": kernel, "read_bandwidth_bytes_s": bandwidth,
            "decode": results, "llama_cpp": why_not or "ran", "prefill": prefill, "plan_int4": plan}


def _prefill(gguf: str, dname: str, quick: bool) -> dict:
    """TTFT (seconds, best of 3) of one ``T``-token random prompt (2,048; 512 quick) for the
    dense model in the bench dtype, int4 at load and the GGUF as stored (one prefill chunk)."""
    from atlas_vlm import LLM, SamplingParams

    T, repeats = (512, 2) if quick else (2048, 3)
    ids = random_prompts(1, T, T, (100, 49152), seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {"tokens": T, "repeats": repeats, "systems": {}}
    for name, quant in ((f"dense {dname}", None), ("int4 at load (group 64)", "int4"), ("GGUF Q4_1 as stored", "gguf")):
        log(f"quantized prefill: {name}")
        llm = LLM(gguf, dtype=dname, quantization=quant, max_model_len=T + 16, max_num_batched_tokens=T,
                  num_kvcache_blocks=T // 16 + 8, enable_prefix_caching=False)
        seconds, _ = best_of(lambda: llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False), repeats)
        out["systems"][name] = seconds
        del llm
    return out


def _plan_int4() -> dict:
    """The issue's planner target: Qwen2.5-VL-3B in int4 on 8 GiB, sequences of 4,096 tokens
    with one 1,280-token image (``atlas-vlm plan``'s arithmetic on the bundled config)."""
    from atlas_vlm.entrypoints.plan import load_config
    from atlas_vlm.memory_plan import GiB, plan

    name, pixels = "Qwen/Qwen2.5-VL-3B-Instruct", 1280 * 28 * 28
    cfg, _ = load_config(name.split("/")[-1])
    p = plan(cfg, gpu_memory=8 * GiB, max_model_len=4096, max_pixels=pixels, quantization="int4")
    return {"model": name, "gpu_memory_gib": 8, "max_model_len": 4096, "max_pixels": pixels,
            "sequences": p.max_num_seqs, "weights_gib": p.weight_bytes / GiB}
