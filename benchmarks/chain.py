"""Chain-size GGUF bench: ours against llama.cpp on the same file, at the model chain's sizes
(``benchmarks.chain_files``: Qwen2.5-0.5B and the language models of Qwen2.5-VL-3B and
Qwen3-VL-4B with random weights, made and quantized to Q4_K_M / Q8_0 by llama.cpp's tools).

Each system runs in its own process (``benchmarks.chain_worker``) so its peak RSS is its own.
The bandwidth limit of a decode token is the read bandwidth (``sum`` over a buffer of at least
4x the L3 cache, printed) over the bytes one token reads (every tensor of the file but a
separate input embedding); it is stated only for files larger than the L3, where a token's
reads really come from DRAM. The issue's targets are stated on the 3B-shaped Q4_K_M file
(``TARGET``): it runs first with the full protocol (``chain_worker``: 128 tokens, 512 / 2,048
prefill, 16 / 64 mixed requests); every other file runs the short one (32 tokens, 512 prefill,
8 mixed requests), since the full protocol on all six files takes over 3 hours on 2 cores.
``--quick``: the 0.5B files only, short protocol.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import llamacpp
from benchmarks.chain_files import CHAIN, QUANT_TYPES, chain_files, tools_missing
from benchmarks.common import fmt, log, markdown_table, read_bandwidth, section


def l3_bytes() -> int:
    """This CPU's L3 cache size in bytes (sysfs, cpu0), 0 where not stated."""
    size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if not size.exists():
        return 0
    text = size.read_text().strip()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    return int(text.rstrip("KM")) * scale


def bytes_per_token(path: Path) -> int:
    """Bytes one decode token reads from the GGUF at ``path``: every tensor, less the input
    embedding where a separate ``output.weight`` is the LM head (one embedding row is read)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    return total - tensors["token_embd.weight"] if "output.weight" in tensors else total


TARGET = ("Qwen2.5-VL-3B LM", "Q4_K_M")  # the file the targets are stated on


def _worker(system: str, path: Path, quick: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.chain_worker", system, str(path)] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False, dtype: torch.dtype | None = None) -> dict:
    """Run the section, print its tables, return the results (seconds, bytes, tok/s).
    ``dtype`` is unused: both systems compute on the file's types as stored."""
    why = tools_missing() or llamacpp.available()
    section("Chain-size GGUF files: ours vs llama.cpp on the same file")
    if why:
        print(f"skipped: {why}")
        return {"skipped": why}
    l3 = l3_bytes()
    bandwidth = read_bandwidth(max(1 << 30, 4 * l3))
    print(f"L3 {l3 / 2**20:.0f} MiB; read bandwidth {bandwidth / 1e9:.1f} GB/s over a {max(1 << 30, 4 * l3) / 2**30:.1f} "
          f"GiB buffer; {torch.get_num_threads()} threads\n")
    files = [(name, qtype, path) for name in (list(CHAIN)[:1] if quick else CHAIN)
             for qtype, path in chain_files(name, QUANT_TYPES, log=log).items()]
    files.sort(key=lambda f: (f[0], f[1]) != TARGET)  # the target file first
    results, rows = {}, []
    for name, qtype, path in files:
        short = quick or (name, qtype) != TARGET
        size, read = path.stat().st_size, bytes_per_token(path)
        r = {"file_bytes": size, "read_bytes": read, "protocol": "short" if short else "full"}
        for system in ("ours", "llama.cpp"):
            log(f"chain bench: {name} {qtype} ({r['protocol']} protocol): {system}")
            r[system] = _worker(system, path, short)
        log(f"chain bench: {name} {qtype}: {json.dumps(r)}")  # each file's figures as soon as they exist
        results[f"{name} {qtype}"] = r
        rows.append(_row(name, qtype, r, bandwidth if size > l3 else None))
    keys = ["decode tok/s", "TTFT 512", "TTFT 2048", "mixed 8", "mixed 16", "mixed 64"]
    print(markdown_table(["file", "MB", "protocol", "ours / llama.cpp: " + ", ".join(keys), "ours of bandwidth limit",
                          "llama.cpp of bandwidth limit", "peak RSS ours / llama.cpp (GB)",
                          "ours: peak RSS / (file + KV)", "greedy = llama.cpp"], rows))
    print("\n(ratios > 1: ours faster; TTFT ratios are llama.cpp's time / ours; '-': not in that protocol)")
    return {"l3_bytes": l3, "read_bandwidth_bytes_s": bandwidth, "files": results}


def _row(name: str, qtype: str, r: dict, bandwidth: float | None) -> list:
    ours, lc = r["ours"], r["llama.cpp"]
    if "error" in ours or "error" in lc:
        return [f"{name} {qtype}", f"{r['file_bytes'] / 1e6:.0f}", r["protocol"], f"ours: {ours.get('error', 'ok')}; "
                f"llama.cpp: {lc.get('error', 'ok')}", "-", "-", "-", "-", "-"]
    ratios = [ours["decode_tok_s"] / lc["decode_tok_s"]]
    for key in ("ttft_512_s", "ttft_2048_s"):
        ratios.append(lc[key] / ours[key] if key in ours else None)
    for key in ("mixed_8_tok_s", "mixed_16_tok_s", "mixed_64_tok_s"):
        ratios.append(ours[key] / lc[key] if key in ours else None)
    limits = [f"{100 * x['decode_tok_s'] * r['read_bytes'] / bandwidth:.0f}%" if bandwidth else "- (file in L3)"
              for x in (ours, lc)]
    same = sum(a == b for a, b in zip(ours["tokens"], lc["tokens"]))
    return [f"{name} {qtype}", f"{r['file_bytes'] / 1e6:.0f}", r["protocol"], " / ".join(fmt(x) for x in ratios),
            *limits, f"{ours['peak_rss_bytes'] / 1e9:.2f} / {lc['peak_rss_bytes'] / 1e9:.2f}",
            fmt(ours["peak_rss_bytes"] / (r["file_bytes"] + ours["kv_bytes"])), f"{same}/{len(lc['tokens'])} tokens"]
