"""The speed targets (docs/performance.md "Targets"), read off one run's results: measured value, target, met.

Each target is computed only from sections that ran (``--text``, ``--vlm``, ``--serve``);
a peer that did not run (llama.cpp not installed, HF continuous batching failed) makes its
row "not measured". Nothing here times anything.
"""

from __future__ import annotations

from benchmarks.common import markdown_table, section


def _serve_ratio(serve: dict, prefix: str) -> float | None:
    systems = serve["systems"]
    ours = systems["(a) ours, one generate call"]
    peer = next((r for name, r in systems.items() if name.startswith(prefix)), None)
    if peer is None or "seconds" not in peer:
        return None
    return peer["seconds"] / ours["seconds"]


def rows(results: dict) -> list[dict]:
    """``[{"target", "measured", "goal", "met"}]``: ratios (x) and fractions (%), ``measured``
    None when the section or the peer did not run."""
    out = []

    def add(target: str, value: float | None, goal: float, unit: str) -> None:
        out.append({"target": target, "measured": value, "goal": goal, "unit": unit,
                    "met": None if value is None else value >= goal})

    serve, text, vlm = results.get("serve"), results.get("text"), results.get("vlm")
    if serve:
        n = serve["num_requests"]
        add(f"{n} mixed requests: ours / HF generate one at a time", _serve_ratio(serve, "(b)"), 8, "x")
        add(f"{n} mixed requests: ours / HF continuous batching", _serve_ratio(serve, "(d)"), 3, "x")
        add(f"{n} mixed requests: ours / llama.cpp one at a time", _serve_ratio(serve, "(e)"), 3, "x")
        big = max(serve["decode_flops"], key=lambda f: f["batch"])
        add(f"decode at batch {big['batch']}: of the {serve['dtype']} GEMM peak (whole engine step)",
            big["frac_peak_step"], 0.5, "%")
    if text:
        pre = text["prefill"]
        add(f"{pre['tokens']}-token prefill: of the {text['dtype']} GEMM peak",
            pre["systems"]["ours"]["frac_peak"], 0.6, "%")
        dec = text["decode"]
        ours, hf = dec["ours paged"]["decode_tok_s"], dec["HF generate"]["decode_tok_s"]
        add("single-request decode: ours / HF generate", ours / hf, 1.2, "x")
        add("single-request decode: of the bandwidth limit", ours / text["bandwidth_limit_tok_s"], 0.75, "%")
        lcpp = next((r for name, r in dec.items() if name.startswith("llama.cpp")), None)
        add("single-request decode: ours / llama.cpp (reported, no target)",
            None if lcpp is None else ours / lcpp["decode_tok_s"], 0, "x")
    quant = results.get("quant")
    if quant:  # issue 19: the embedded Q4_1 GGUF as stored, in the bench dtype
        dec = quant["decode"]
        q4 = next(r for name, r in dec.items() if name.startswith("GGUF Q4_1 as stored"))
        lcpp = dec.get("llama.cpp (GGUF as stored)")
        add("single-request decode, Q4_1 GGUF as stored: ours / llama.cpp (issue 19)",
            None if lcpp is None else q4["decode_tok_s"] / lcpp["decode_tok_s"], 1.0, "x")
        add("single-request decode, Q4_1 GGUF as stored: of the bandwidth limit of bytes read (issue 19)",
            q4["decode_tok_s"] / q4["limit_tok_s"], 0.6, "%")
        if "prefill" in quant:
            pre = quant["prefill"]
            dense = next(sec for name, sec in pre["systems"].items() if name.startswith("dense"))
            add(f"{pre['tokens']}-token prefill, int4 at load: dense TTFT / int4 TTFT (issue 19)",
                dense / pre["systems"]["int4 at load (group 64)"], 1.0, "x")
        if "plan_int4" in quant:
            add("planner: Qwen2.5-VL-3B int4 on 8 GiB, sequences of 4,096 tokens + one image (issue 19)",
                quant["plan_int4"]["sequences"], 8, "n")
    spec = results.get("spec")
    if spec:  # issue 26: n-gram speculation on vs off, one stream per task and batches
        for task, r in spec["tasks"].items():
            goal = 0.97 if task.startswith("free writing") else 1.8
            add(f"speculative decoding, one stream, {task}: on / off (acceptance {r['acceptance']:.0%}) (issue 26)",
                r["speedup"], goal, "x")
        for batch, r in spec["batches"].items():
            add(f"speculative decoding, {batch} requests: on / off (issue 26)", r["speedup"], 1.0, "x")
    kv = results.get("kv")
    if kv:  # issue 27
        add("int8 KV: tokens in the same pool bytes / auto (issue 27)", kv["int8"]["tokens_ratio"], 1.9, "x")
        add("decode at batch 32: int8 KV / auto tok/s (issue 27)", kv["int8"]["decode_ratio"], 0.9, "x")
        add("long chat evicted, asked again: re-prefill / disk-tier TTFT (issue 27)",
            kv["evicted_chat"]["speedup"], 3, "x")
        add("image + question after a restart: cold / restarted TTFT (issue 27)", kv["restart_image"]["speedup"], 5, "x")
    hybrid = results.get("hybrid_prefix")
    if hybrid:  # issue 25: prefix caching of hybrid models (state snapshots), exact
        add("Qwen3.5 shared prefix + image, new question: miss / hit TTFT (issue 25)",
            hybrid["speedup"] if hybrid["identical"] else 0.0, 3, "x")
    if vlm and "1024x28x28" in vlm:
        add("image TTFT at 1024*28*28 pixels: HF / ours", vlm["1024x28x28"]["speedup_hf_over_ours"], 1.3, "x")
    return out


def report(results: dict) -> list[dict]:
    """Print the targets table; return ``rows(results)``."""
    table = rows(results)
    if not table:
        return table
    section("Targets: this run against each goal")

    def cell(value: float | None, unit: str) -> str:
        if value is None:
            return "not measured"
        if unit == "n":
            return f"{value:.0f}"
        return f"{100 * value:.0f}%" if unit == "%" else f"{value:.2f}x"

    print(markdown_table(["target", "measured", "goal", "met"],
                         [[r["target"], cell(r["measured"], r["unit"]),
                           "-" if r["goal"] == 0 else cell(r["goal"], r["unit"]),
                           "-" if r["goal"] == 0 or r["met"] is None else ("yes" if r["met"] else "no")]
                          for r in table]))
    return table
