#!/usr/bin/env python
"""The MTP drafter's own cost (docs/speculative.md): time of its work per decode step (the
MTP layer over the step's positions + k - 1 chained steps, each with the LM head) against the
target's forward of the same step, on a small random all-full-attention Qwen3.5 (built in a
temporary folder; nothing downloaded). One request, greedy, ``--threads`` CPU threads; k
drafts every step (the acceptance floor off: random drafts are rarely accepted).

    python scripts/mtp_cost.py [--threads 1] [--dtype float32] [--k 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=4, help="drafts per step")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated")
    p.add_argument("--layers", type=int, default=8, help="target decoder layers")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from qwen3_5_helpers import build_tiny_qwen3_5, random_mtp_weights, tiny_config

    from atlas_vlm import LLM, SamplingParams
    from atlas_vlm.spec_decode import scheduling

    scheduling.ACCEPTANCE_FLOOR = 0.0  # k drafts every step (random drafts are rarely accepted)

    config = tiny_config()
    text = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=args.layers,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, layer_types=["full_attention"] * args.layers)
    text["rope_parameters"] = dict(config.text_config.rope_parameters, mrope_section=[3, 3, 2])  # 16 rotary dims
    for name, value in text.items():
        setattr(config.text_config, name, value)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_qwen3_5(Path(tmp), seed=0, text_only=True, config=config,
                           mtp=random_mtp_weights(config.text_config, seed=1))
        llm = LLM(tmp, dtype=args.dtype, num_threads=args.threads, speculative="mtp", num_speculative_tokens=args.k,
                  kv_cache_memory=1 << 28)
        runner = llm.engine.runner
        times = {"target": [], "draft": []}
        forward, after = runner.forward_logits, runner.drafter.after_step

        def timed(key, fn):
            def run(*a, **kw):
                t = time.perf_counter()
                out = fn(*a, **kw)
                times[key].append(time.perf_counter() - t)
                return out
            return run

        runner.forward_logits, runner.drafter.after_step = timed("target", forward), timed("draft", after)
        llm.generate([list(range(100, 132))], SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
                     use_tqdm=False)
    target, draft = sorted(times["target"][1:]), sorted(times["draft"][1:])  # the prefill step left out
    t, d = target[len(target) // 2] * 1e3, draft[len(draft) // 2] * 1e3
    print(f"{args.layers}-layer random Qwen3.5 (hidden 512, vocab 32000), {args.dtype}, {args.threads} thread(s), "
          f"k={args.k}: median decode step target {t:.2f} ms, drafter {d:.2f} ms ({d / t:.2f}x), "
          f"{len(target)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
