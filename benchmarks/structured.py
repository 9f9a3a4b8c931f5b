"""Structured output (issue 18): what a grammar costs.

- compile time of a JSON schema, per grammar library on the engine's tokenizer (llguidance,
  the engine's; xgrammar too when installed, the alternative we measured it against), and
  the mask time per token of each library on the same random walk through the grammar;
- output tok/s of 64 requests with a JSON schema against the same 64 unconstrained, in the
  same run (same prompts, same number of output tokens: the schema's array is longer than
  ``max_tokens``, so every constrained request ends by length like the unconstrained ones
  with ``ignore_eos``); target: at most 10% slower.

Model: the embedded SmolLM2-135M-Instruct (real weights). Times in seconds.
"""

from __future__ import annotations

import json
import statistics

import torch

from benchmarks.common import markdown_table, now, section

# a receipt: nested objects, enums, bounded strings; the array outlasts any max_tokens here
SCHEMA = {
    "type": "object",
    "properties": {
        "merchant": {"type": "string", "maxLength": 24},
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "items": {"type": "array", "minItems": 200, "maxItems": 400,
                  "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                             "qty": {"type": "integer", "minimum": 1,
                                                                     "maximum": 99},
                                                             "price": {"type": "number"}},
                            "required": ["name", "qty", "price"], "additionalProperties": False}},
    },
    "required": ["merchant", "currency", "items"],
    "additionalProperties": False,
}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _timed(fn) -> float:
    t0 = now()
    fn()
    return now() - t0


def _walk(fill, accept, vocab: int, steps: int, seed: int) -> list[float]:
    """Seconds per mask over a random walk of ``steps`` tokens allowed by the grammar."""
    from atlas_vlm.structured_output.backend import apply_token_bitmask

    g = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        t0 = now()
        mask = fill()
        times.append(now() - t0)
        logits = apply_token_bitmask(torch.randn(1, vocab, generator=g), mask)
        if not torch.isfinite(logits.max()):
            break
        if not accept(int(logits.argmax())):
            break
    return times


def _libraries(tokenizer, vocab: int, eos: set[int], quick: bool) -> dict:
    """Compile and mask times per library on ``tokenizer``."""
    from atlas_vlm.structured_output import StructuredOutputsParams
    from atlas_vlm.structured_output.backend import GuidanceBackend, allocate_token_bitmask

    steps = 48 if quick else 128
    res = {}
    t0 = now()
    backend = GuidanceBackend(tokenizer, vocab, eos)
    res["llguidance"] = {"tokenizer_setup_s": now() - t0}
    for name, schema in (("person", PERSON), ("receipt", SCHEMA)):
        params = StructuredOutputsParams(json=schema)
        compiles = []
        for _ in range(5):
            backend.clear_compiled()
            t0 = now()
            backend.compile_grammar(params)
            compiles.append(now() - t0)
        t0 = now()
        grammar = backend.compile_grammar(params)  # the same grammar again: a copy of the compiled one
        res["llguidance"].setdefault("cached_compile_s", {})[name] = now() - t0
        bitmask = allocate_token_bitmask(1, backend.mask_vocab_size)

        def fill(grammar=grammar, bitmask=bitmask):
            grammar.fill_bitmask(bitmask, 0)
            return bitmask[:, : (vocab + 31) // 32]

        masks = _walk(fill, grammar.accept_token, vocab, steps, seed=0)
        res["llguidance"][name] = {"compile_s": statistics.median(compiles),
                                   "mask_s_per_token": statistics.median(masks)}
    try:
        import xgrammar as xgr
    except ImportError:
        res["xgrammar"] = None
        return res
    t0 = now()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab),
                                   cache_enabled=False)
    res["xgrammar"] = {"tokenizer_setup_s": now() - t0}
    for name, schema in (("person", PERSON), ("receipt", SCHEMA)):
        compiles = []
        for _ in range(5):
            t0 = now()
            compiler.compile_json_schema(json.dumps(schema))
            compiles.append(now() - t0)
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def fill(matcher=matcher, bitmask=bitmask):
            matcher.fill_next_token_bitmask(bitmask, 0)
            return bitmask

        masks = _walk(fill, matcher.accept_token, vocab, steps, seed=0)
        res["xgrammar"][name] = {"compile_s": statistics.median(compiles),
                                 "mask_s_per_token": statistics.median(masks)}
    return res


def run(quick: bool = False, dtype=None) -> dict:
    from atlas_vlm import LLM, SamplingParams
    from atlas_vlm.default_models import default_text_model

    num, max_tokens = 64, (16 if quick else 128)
    kwargs = {"dtype": str(dtype).removeprefix("torch.")} if dtype is not None else {}
    llm = LLM(default_text_model(), max_model_len=1024, **kwargs)
    engine = llm.engine
    libs = _libraries(llm.tokenizer, engine.vocab_size, engine.eos_token_ids, quick)
    prompts = [f"Receipt {i}: {i % 7 + 1} coffees and {i % 3 + 1} bagels at Cafe {i}. As JSON:" for i in range(num)]
    free = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                 structured_outputs={"json": SCHEMA})
    llm.generate(prompts[:2], [free, constrained], use_tqdm=False)  # warm-up (grammar tables, kernels)
    mgr = engine.structured_output_manager
    runs = {}
    order = [("unconstrained", free), ("json_schema", constrained)] + ([] if quick else [("unconstrained_again", free)])
    for name, params in order:
        before = (mgr.stats.mask_s, mgr.stats.num_masks, mgr.stats.compile_s, mgr.stats.num_compiled,
                  mgr.stats.mask_wait_s)
        t0 = now()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = now() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        runs[name] = {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
                      "finish": sorted({o.finish_reason for o in outs}),
                      "mask_s": mgr.stats.mask_s - before[0], "masks": mgr.stats.num_masks - before[1],
                      "compile_s": mgr.stats.compile_s - before[2], "compiled": mgr.stats.num_compiled - before[3],
                      "mask_wait_s": mgr.stats.mask_wait_s - before[4]}
        if name == "json_schema":
            parsed_prefix = all(o.text.startswith('{"merchant": "') for o in outs)
            runs[name]["outputs_follow_schema_prefix"] = parsed_prefix
    base = statistics.mean([r["output_tok_s"] for name, r in runs.items() if name.startswith("unconstrained")])
    slowdown = 1 - runs["json_schema"]["output_tok_s"] / base
    js = runs["json_schema"]
    from atlas_vlm.structured_output.backend import allocate_token_bitmask, apply_token_bitmask

    logits, bitmask = torch.randn(num, engine.vocab_size), allocate_token_bitmask(num, engine.vocab_size)
    apply_s = statistics.median([_timed(lambda: apply_token_bitmask(logits, bitmask)) for _ in range(10)])
    steps = js["masks"] / num  # decode steps of the constrained run (every row constrained each step)
    grammar_s = js["mask_wait_s"] + js["compile_s"] + apply_s * steps  # what the engine thread waited for
    res = {"apply_s_per_step": apply_s, "grammar_share_of_wall": grammar_s / js["wall_s"],"libraries": libs, "runs": runs, "num_requests": num, "max_tokens": max_tokens,
           "slowdown": slowdown, "target_met": slowdown <= 0.10,
           "engine_mask_s_per_token": js["mask_s"] / max(js["masks"], 1),
           "engine_compile_s_per_request": js["compile_s"] / max(js["compiled"], 1)}

    section(f"Structured output (SmolLM2-135M, {num} raw prompts x {max_tokens} tokens, greedy)")
    rows = []
    for lib, r in libs.items():
        if r is None:
            rows.append([lib, "not installed", "-", "-", "-", "-"])
            continue
        rows.append([lib, f"{r['tokenizer_setup_s']:.2f}", f"{r['person']['compile_s'] * 1e3:.2f}",
                     f"{r['receipt']['compile_s'] * 1e3:.2f}", f"{r['person']['mask_s_per_token'] * 1e6:.0f}",
                     f"{r['receipt']['mask_s_per_token'] * 1e6:.0f}"])
    print(markdown_table(["library", "tokenizer setup s", "compile ms (person)", "compile ms (receipt)",
                          "mask us/token (person)", "mask us/token (receipt)"], rows))
    print()
    rows = [[name, f"{r['output_tok_s']:.1f}", f"{r['wall_s']:.2f}", r["output_tokens"], ",".join(r["finish"])]
            for name, r in runs.items()]
    print(markdown_table(["64 requests", "output tok/s", "wall s", "output tokens", "finish"], rows))
    print(f"\nengine, json_schema run: compile {res['engine_compile_s_per_request'] * 1e3:.2f} ms/request, "
          f"masks {res['engine_mask_s_per_token'] * 1e6:.0f} us/token ({js['masks']} rows, filled beside the "
          f"forward; {js['mask_wait_s'] / max(js['masks'], 1) * 1e6:.0f} us/token waited for after it); "
          f"tok/s vs unconstrained{'' if quick else ' (mean of the runs before and after)'}: {-slowdown * 100:+.1f}% "
          f"(target: at most 10% slower: {'met' if res['target_met'] else 'not met'}); grammar work "
          f"(compile + waiting for masks + {apply_s * 1e3:.1f} ms/step applying them to [{num}, {engine.vocab_size}] logits) "
          f"= {res['grammar_share_of_wall'] * 100:.1f}% of the constrained run's wall time")
    return res
