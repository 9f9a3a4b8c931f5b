#!/usr/bin/env python
"""Benchmark Atlas VLM against its peers in one process, on the same prompts; prints ratios.

    python scripts/bench.py                 # all sections (text, quant, vlm, serve, detok), ~11 min on 2 cores
    python scripts/bench.py --quick         # smaller sizes, a few minutes
    python scripts/bench.py --text --serve --json results.json
    python scripts/bench.py --server --quick  # HTTP: atlas-vlm serve vs transformers serve
    python scripts/bench.py --replicas --quick  # 1 vs 2 replicas (Ray Serve), cache-aware vs least-loaded
    python scripts/bench.py --structured --quick  # JSON-schema grammars: compile, mask, tok/s vs unconstrained
    python scripts/bench.py --video --quick  # video only: 3 s / 60 s clip TTFT, tok/s vs HF; load_video peak RSS
    python scripts/bench.py --chain --quick  # chain-size Q4_K_M / Q8_0 files vs llama.cpp (setup.sh --bench first)
    python scripts/bench.py --chain --chain-match Coder  # the real Qwen2.5-Coder-1.5B Q4_K_M alone vs llama.cpp
    python scripts/bench.py --served         # our server on the real file: int8 vs default KV, ngram vs one stream
    python scripts/bench.py --spec --kv      # speculative decoding on/off; 8-bit KV and the disk tier
    python scripts/bench.py --qwen35 --threads 1  # Qwen3.5 (scaled-down 0.8B shapes): 16 / 64 requests vs HF
    python scripts/bench.py --hybrid-prefix  # Qwen3.5 prefix caching (state snapshots): hit vs miss TTFT, < 3 min

Sections: --text (decode tok/s paged/contiguous vs HF generate and llama.cpp, against the
bandwidth limit; a 2,048-token prefill vs the GEMM peak; KV waste), --quant (decode tok/s of
dense fp32, the Q4_1 GGUF as stored and int8 / int4 at load, against the bandwidth limit of the
bytes each reads and llama.cpp), --vlm (time to first token
with one image vs HF Qwen2.5-VL; then --video: TTFT and decode tok/s with a 3 s and a 60 s
clip made with PyAV vs HF generate on the same frames, and load_video's peak RSS on each clip
in a fresh process), --serve (many requests vs HF sequential, padded batches, HF
continuous batching and llama.cpp; KV reserved-but-empty; decode FLOP/s vs the measured GEMM
peak; VLM mix with prefix + encoder caches on vs off), --detok (output
processing cost per token at the start and the end of a long output), --structured (grammar
compile and mask time per library, 64 requests with a JSON schema vs unconstrained), --server (open-loop
Poisson HTTP load on atlas-vlm serve and transformers serve, offline LLM.chat on the same
requests; not part of the default run), --hybrid-prefix (a random scaled-down Qwen3.5 VLM, a
~2,000-token system prompt + image shared: TTFT of a hit vs a miss, fp32, tokens compared; not
part of the default run). --text/--vlm/--serve run every system in the
``--dtype`` (default: what ``dtype="auto"`` picks here, bf16 on a CPU with AMX/AVX512-BF16)
and end with the issue-10 targets table. llama.cpp is optional (``bash scripts/setup.sh
--bench`` builds llama-cpp-python; "not installed" otherwise). Logic: benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", action="store_true", help="decode speed and KV memory (SmolLM2-135M)")
    p.add_argument("--vlm", action="store_true", help="time to first token with one image")
    p.add_argument("--video", action="store_true",
                   help="video TTFT / tok/s vs HF (3 s and 60 s clip), load_video peak RSS (part of --vlm)")
    p.add_argument("--serve", action="store_true", help="many requests, KV use, FLOP/s, VLM mix")
    p.add_argument("--detok", action="store_true", help="output processing cost per token vs output length")
    p.add_argument("--quant", action="store_true",
                   help="decode tok/s dense fp32 vs GGUF Q4_1 as stored vs int8 / int4 (SmolLM2-135M)")
    p.add_argument("--structured", action="store_true",
                   help="JSON-schema compile / mask time, 64 constrained vs unconstrained requests")
    p.add_argument("--server", action="store_true",
                   help="HTTP load (Poisson arrivals) on atlas-vlm serve vs transformers serve")
    p.add_argument("--replicas", action="store_true",
                   help="1 vs 2 replicas (Ray Serve), cache-aware vs least-loaded routing; needs the ray extra")
    p.add_argument("--chain", action="store_true",
                   help="chain-size GGUF files (0.5B / 3B / 4B shapes, Q4_K_M and Q8_0 by llama.cpp's tools): ours vs "
                        "llama.cpp on the same file; part of the default run")
    p.add_argument("--chain-quantization", default=None, metavar="Q",
                   help="with --chain / --served: the quantization ours loads each file with, as LLM(quantization=Q) "
                        "and serve --quantization Q take it (e.g. gguf; default: none named, as a user runs LLM(FILE))")
    p.add_argument("--chain-match", default=None, metavar="TEXT",
                   help="with --chain: only the files whose label contains TEXT (e.g. Coder: the real file, 3B)")
    p.add_argument("--served", action="store_true",
                   help="the real Qwen2.5-Coder-1.5B file as served (atlas-vlm serve at the same threads): "
                        "--kv-cache-dtype int8 vs default KV, --speculative ngram vs one stream on a copy-heavy "
                        "edit; not part of the default run")
    p.add_argument("--spec", action="store_true",
                   help="n-gram speculative decoding on vs off: copy-heavy and free-writing tasks, batches 16 / 64")
    p.add_argument("--spec-quantization", choices=["gguf", "int8", "int4"], default=None,
                   help="with --spec: load SmolLM2 quantized (gguf: the Q4_1 file as stored, the one-call C "
                        "decode step) instead of dequantized")
    p.add_argument("--kv", action="store_true",
                   help="int8 vs auto K/V (pool tokens, decode at batch 32); the disk tier (evicted chat, restart)")
    p.add_argument("--qwen35", action="store_true",
                   help="Qwen3.5 decode tok/s (random, 0.8B shapes scaled down): ours at 16 / 64 requests vs HF "
                        "generate one at a time; not part of the default run")
    p.add_argument("--hybrid-prefix", action="store_true",
                   help="Qwen3.5 prefix caching (state snapshots): TTFT of a hit vs a miss after a shared "
                        "~2,000-token system prompt + image (random scaled-down model, fp32)")
    p.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="dtype of ours and the HF peers in --text/--vlm/--serve (auto: as LLM(dtype='auto') on "
                        "this machine)")
    p.add_argument("--json", metavar="PATH", help="write all results (seconds, bytes, ratios) as JSON")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for every system (default: torch's choice); on a CPU shared "
                        "with other work, 1 avoids OpenMP waits that slow small ops 10-100x")
    args = p.parse_args(argv)
    if not (args.text or args.vlm or args.video or args.serve or args.detok or args.server or args.replicas or args.quant
            or args.structured or args.chain or args.spec or args.kv or args.qwen35 or args.hybrid_prefix
            or args.served):
        args.text = args.vlm = args.serve = args.detok = args.quant = args.structured = args.chain = True
        args.spec = args.kv = True
    args.video = args.video or args.vlm
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ lives beside scripts/
    import logging
    import os

    import torch

    from atlas_vlm import EngineConfig
    from benchmarks import (chain, detokenize, hybrid_prefix, kv_tiers, quant, qwen3_5, serve, served_real, server,
                            spec_decode, structured, targets, text, video, vlm)

    replicas = None
    if args.replicas:
        from benchmarks import replicas

    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    # one thread count for every system and section: the engine's own choice (cores less the load
    # average, made at its first LLM) would otherwise change it mid-run on a busy machine
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    dtype = EngineConfig(model="-", dtype=args.dtype, device="cpu").torch_dtype()
    results = {"quick": args.quick, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "dtype": str(dtype)}
    print(f"dtype {dtype} (--dtype {args.dtype}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    from atlas_vlm import hardware
    from atlas_vlm.kernels import quant_kernel
    from benchmarks import llamacpp

    # the two quantized paths side by side: our kernel variant and what llama.cpp was built with
    results["cpu"] = hardware.cpu_features().describe()
    results["our_kernel"] = quant_kernel.isa() or "none (PyTorch reference path)"
    results["llama_cpp_system_info"] = llamacpp.system_info()
    print(f"CPU: {results['cpu']}\nour quantized kernel: {results['our_kernel']}\n"
          f"llama.cpp system_info: {results['llama_cpp_system_info']}")
    start = time.perf_counter()
    for name, module in (("text", text), ("quant", quant), ("vlm", vlm), ("video", video), ("serve", serve), ("detok", detokenize),
                         ("structured", structured), ("chain", chain), ("spec", spec_decode), ("kv", kv_tiers),
                         ("server", server), ("replicas", replicas), ("qwen35", qwen3_5),
                         ("hybrid_prefix", hybrid_prefix), ("served", served_real)):
        if getattr(args, name):
            kwargs = {"dtype": dtype} if name in ("text", "quant", "vlm", "video", "serve", "structured", "spec",
                                                  "kv", "qwen35") else {}
            if name == "spec" and args.spec_quantization:
                kwargs["quantization"] = args.spec_quantization
            if name == "chain":
                kwargs.update(quantization=args.chain_quantization, match=args.chain_match)
            if name == "served":
                kwargs["quantization"] = args.chain_quantization
            results[name] = module.run(quick=args.quick, **kwargs)
    results["targets"] = targets.report(results)
    results["wall_s"] = time.perf_counter() - start
    print(f"\n(total benchmark wall time {results['wall_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
