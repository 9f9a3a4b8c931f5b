"""Speculative decoding (n-gram drafts) on the real embedded SmolLM2-135M: speculation on vs
off on the same greedy requests, in one process.

Tasks (issue 26): three copy-heavy ones (rewrite a JSON object changing one field, correct
typos in a paragraph, extract fields from a given document) and one free-writing one. For each
task: one stream, tok/s with ``speculative="ngram"`` over tok/s without, the acceptance rate
(accepted / proposed drafts), and whether the tokens are identical (they must be: greedy).
Then batches of 16 and 64 requests mixing the four tasks: throughput on / off.
``quantization="gguf"`` (``scripts/bench.py --spec-quantization gguf``) runs the GGUF as stored
(the one-call C decode step, ``kernels.decode_step``) instead of dequantized; the steps each
executor ran are reported (``runner.executor_steps``), and one stream per task is timed again
alternating, best of 3: off, on with drafted steps op by op (only undrafted steps in the
one-call step: the routing before it verified drafts), on with drafted steps in it.
Units: seconds of wall clock; tok/s counts generated tokens.
"""

from __future__ import annotations

from benchmarks.common import best_of, log, markdown_table, section

JSON_DOC = ('{"id": 48213, "name": "Ada Lovelace", "email": "ada@example.org", "city": "London", '
            '"country": "United Kingdom", "role": "analyst", "team": "engines", "languages": ["English", '
            '"French", "Italian"], "active": true, "joined": "1843-07-10", "manager": "Charles Babbage"}')
TYPO_TEXT = ("Teh analytical engine was a propsed mechanical general-purpose computer desgined by Charles "
             "Babbage. It was first descirbed in 1837 as the sucessor to Babbage's diffrence engine, which "
             "was a design for a simpler mechanical calculater. The analytical engine incorperated an "
             "arithmetic logic unit, control flow in the form of conditonal branching and loops, and "
             "integrated memmory, making it the first design for a general-purpose computer.")
DOCUMENT = ("INVOICE No. 2024-0117\nDate: 14 March 2024\nBilled to: Northwind Traders, 12 Harbour Street, "
            "Bristol BS1 4RN\nItems: 3 x Oak desk (GBP 240.00 each), 6 x Office chair (GBP 85.50 each)\n"
            "Subtotal: GBP 1,233.00\nVAT (20%): GBP 246.60\nTotal due: GBP 1,479.60\nPayment terms: 30 days")
TASKS = {
    "rewrite JSON (one field changed)":
        f"Here is a JSON object:\n{JSON_DOC}\nRewrite the whole object exactly, changing only the city to "
        "\"Paris\". Output only the JSON.",
    "correct typos":
        f"Correct the spelling mistakes in this paragraph and output the corrected paragraph only:\n{TYPO_TEXT}",
    "extract fields":
        f"{DOCUMENT}\n\nCopy the invoice number, the date, the customer's name and address, and the total due "
        "from the document above, one per line, exactly as written.",
    "free writing (no copying)": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _run(llm, prompts, params) -> tuple[float, list]:
    """Best wall time of one ``chat`` call over ``prompts`` and its outputs."""
    convs = [[{"role": "user", "content": p}] for p in prompts]
    return best_of(lambda: llm.chat(convs, params, use_tqdm=False), repeats=1, warmup=1)


def _one_call_ab(off, on, params) -> dict:
    """Per task, tok/s of ``off``, of ``on`` with drafted steps op by op and of ``on`` with
    drafted steps in the one-call step, timed alternating (best of 3: the shared CPU's load
    moves all three alike)."""
    step = on.engine.runner.decode_step
    undrafted = type("UndraftedOnly", (), {  # a step of one row per request: no drafts
        "applies": lambda self, meta, rows, media: rows == len(meta.query_lens) and step.applies(meta, rows, media),
        "__call__": lambda self, *a: step(*a)})()
    out, table = {}, []
    for name, prompt in TASKS.items():
        best, convs = {}, [[{"role": "user", "content": prompt}]]
        modes = (("off", off, None), ("drafted op by op", on, undrafted), ("drafted in C", on, step))
        for _ in range(3):  # warm already (the table above ran every task)
            for mode, llm, impl in modes:
                if impl is not None:
                    on.engine.runner.decode_step = impl
                t, o = best_of(lambda: llm.chat(convs, params, use_tqdm=False), repeats=1, warmup=0)
                best[mode] = min(best.get(mode, t), t)
        n = len(o[0].token_ids)
        out[name] = {m: n / t for m, t in best.items()}
        table.append([name, n, *(f"{n / t:.1f}" for t in best.values()),
                      f"{best['off'] / best['drafted op by op']:.2f}x", f"{best['off'] / best['drafted in C']:.2f}x"])
    on.engine.runner.decode_step = step
    print(markdown_table(["one stream (best of 3)", "tokens", "off tok/s", "drafted op by op tok/s",
                          "drafted in C tok/s", "on / off, op by op", "on / off, in C"], table))
    return out


def run(quick: bool = False, dtype=None, quantization: str | None = None) -> dict:
    from atlas_vlm import LLM, SamplingParams
    from atlas_vlm.default_models import default_text_model
    from benchmarks.common import dtype_name

    n_tokens = 96 if quick else 192
    kw = dict(dtype=dtype_name(dtype) if dtype is not None else "auto", max_model_len=2048,
              kv_cache_memory=1 << 30, max_num_seqs=64, **({"quantization": quantization} if quantization else {}))
    off = LLM(default_text_model(), **kw)
    on = LLM(default_text_model(), speculative="ngram", num_speculative_tokens=4, **kw)
    params = SamplingParams(temperature=0, max_tokens=n_tokens)
    weights = f"quantized ({quantization})" if quantization else "dense"
    section(f"Speculative decoding (n-gram drafts, k=4) on SmolLM2-135M, {weights}, {kw['dtype']}, greedy, "
            f"up to {n_tokens} tokens")
    res: dict = {"tasks": {}, "batches": {}, "max_tokens": n_tokens, "weights": weights}
    table = []
    for name, prompt in TASKS.items():
        log(name)
        t_off, o_off = _run(off, [prompt], params)
        t_on, o_on = _run(on, [prompt], params)
        n = len(o_off[0].token_ids)
        sd = o_on[0].spec_decode or {"proposed": 0, "accepted": 0}
        rate = sd["accepted"] / sd["proposed"] if sd["proposed"] else 0.0
        same = o_on[0].token_ids == o_off[0].token_ids
        res["tasks"][name] = {"tokens": n, "off_s": t_off, "on_s": t_on, "speedup": (n / t_on) / (n / t_off),
                              "acceptance": rate, "identical": same}
        table.append([name, n, f"{n / t_off:.1f}", f"{n / t_on:.1f}", f"{t_off / t_on:.2f}x", f"{rate:.0%}", same])
    print(markdown_table(["one stream", "tokens", "off tok/s", "on tok/s", "on / off", "acceptance", "identical"],
                         table))
    rows = []
    for batch in ((16,) if quick else (16, 64)):
        prompts = [list(TASKS.values())[i % len(TASKS)] for i in range(batch)]
        log(f"batch {batch}")
        t_off, o_off = _run(off, prompts, params)
        t_on, o_on = _run(on, prompts, params)
        toks = sum(len(o.token_ids) for o in o_off)
        same = all(a.token_ids == b.token_ids for a, b in zip(o_on, o_off))
        res["batches"][batch] = {"tokens": toks, "off_s": t_off, "on_s": t_on, "speedup": t_off / t_on,
                                 "identical": same}
        rows.append([batch, toks, f"{toks / t_off:.1f}", f"{toks / t_on:.1f}", f"{t_off / t_on:.2f}x", same])
    print()
    print(markdown_table(["requests", "tokens", "off tok/s", "on tok/s", "on / off", "identical"], rows))
    res["executor_steps"] = {"off": dict(off.engine.runner.executor_steps), "on": dict(on.engine.runner.executor_steps)}
    print(f"steps per executor: off {res['executor_steps']['off']}, on {res['executor_steps']['on']}")
    if quantization and on.engine.runner.decode_step is not None:
        print()
        res["one_call_ab"] = _one_call_ab(off, on, params)
    return res
