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

The real file (``benchmarks.real_file``: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, assembled by
``setup.sh --bench``) runs before all of them with the full protocol, plus greedy agreement
with llama.cpp over 128 tokens on three chat prompts (same prompt ids: ours renders them,
llama.cpp gets the ids); ``--quick`` leaves it out unless ``match`` selects it (then the short
protocol). Both sides run at the same thread count (``threads``), printed per side with each
side's load time (page cache warmed first) and peak RSS. Ours loads each file as a user would (``LLM(FILE)``) unless
``quantization`` names one (``scripts/bench.py --chain-quantization``). ``match``: only the
files whose label contains it (``scripts/bench.py --chain-match Coder``: the real file alone).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import llamacpp, real_file
from benchmarks.chain_files import CHAIN, QUANT_TYPES, chain_files, tools_missing
from benchmarks.chain_worker import agreement
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


TARGET = ("Qwen2.5-VL-3B LM", "Q4_K_M")  # the shaped file the targets are stated on
REAL = ("Qwen2.5-Coder-1.5B-Instruct (real)", "Q4_K_M")  # benchmarks.real_file
WORKER_TIMEOUT_S = 3 * 3600  # one system on one file; the full protocol takes minutes on 2 idle cores


def _worker(system: str, path: Path, quick: bool, threads: int, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.chain_worker", system, str(path), "--threads", str(threads), *extra]
    try:
        done = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {WORKER_TIMEOUT_S} s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm_page_cache(path: Path) -> None:
    """Read ``path`` once so that both sides' load times are taken with a warm page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _files(quick: bool, match: str | None, log) -> tuple[list[tuple[str, str, Path]], list[str]]:
    """(label, type, path) of the files to run, the real file first, then the target file; and
    the notes on files that are not there."""
    files, notes = [], []
    real = real_file.default_path()
    if quick and not match:
        notes.append("--quick: the real file is left out (--chain-match Coder runs it alone, short protocol)")
    elif real_file.is_correct(real):
        files.append((*REAL, real))
    else:
        notes.append(f"real file absent or not verified at {real} (bash scripts/setup.sh --bench)")
    why = tools_missing()
    if why:
        notes.append(f"chain-size files: {why}")
    else:
        names = [n for n in (list(CHAIN)[:1] if quick else CHAIN) if not match or match in n]
        shaped = [(n, t, p) for n in names for t, p in chain_files(n, QUANT_TYPES, log=log).items()]
        shaped.sort(key=lambda f: (f[0], f[1]) != TARGET)  # the target file first
        files += shaped
    return [f for f in files if not match or match in f"{f[0]} {f[1]}"], notes


def run(quick: bool = False, dtype: torch.dtype | None = None, quantization: str | None = None,
        match: str | None = None) -> dict:
    """Run the section, print its tables, return the results (seconds, bytes, tok/s).
    ``dtype`` is unused: both systems compute on the file's types as stored. ``quantization``:
    passed to ours' ``LLM`` (None: as a user loads the file). ``match``: see the module docstring."""
    why = llamacpp.available()
    section("GGUF files: ours vs llama.cpp on the same file (the real Qwen2.5-Coder-1.5B first, then chain sizes)")
    if why:
        print(f"skipped: llama.cpp {why}")
        return {"skipped": why}
    threads = torch.get_num_threads()
    files, notes = _files(quick, match, log)
    for note in notes:
        print(f"note: {note}")
    if not files:
        return {"skipped": "; ".join(notes) or f"no file matches {match!r}"}
    l3 = l3_bytes()
    bandwidth = read_bandwidth(max(1 << 30, 4 * l3))
    print(f"L3 {l3 / 2**20:.0f} MiB; read bandwidth {bandwidth / 1e9:.1f} GB/s over a {max(1 << 30, 4 * l3) / 2**30:.1f} "
          f"GiB buffer; {threads} threads per side; ours loads with quantization={quantization!r}\n")
    extra = ["--quantization", quantization] if quantization else []
    results, rows, details = {}, [], []
    for name, qtype, path in files:
        is_real = (name, qtype) == REAL
        short = quick or not is_real and (name, qtype) != TARGET
        size, read = path.stat().st_size, bytes_per_token(path)
        r = {"file_bytes": size, "read_bytes": read, "protocol": "short" if short else "full"}
        warm_page_cache(path)
        log(f"chain bench: {name} {qtype} ({r['protocol']} protocol): ours")
        r["ours"] = _worker("ours", path, short, threads, extra + (["--agree"] if is_real else []))
        chat = r["ours"].get("chat")
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump([c["prompt_ids"] for c in chat] if chat else [], f)
            f.flush()
            log(f"chain bench: {name} {qtype} ({r['protocol']} protocol): llama.cpp")
            r["llama.cpp"] = _worker("llama.cpp", path, short, threads, ["--chat-ids", f.name] if chat else [])
        if chat and "chat" in r["llama.cpp"]:
            r["agreement"] = [agreement(a["tokens"], b["tokens"]) for a, b in zip(chat, r["llama.cpp"]["chat"])]
        log(f"chain bench: {name} {qtype}: {json.dumps({k: v for k, v in r.items() if k not in ('ours', 'llama.cpp')})}")
        results[f"{name} {qtype}"] = r
        rows.append(_row(name, qtype, r, bandwidth if size > l3 else None))
        details += figures(f"{name} {qtype}", r)
    keys = ["decode tok/s", "TTFT 512", "TTFT 2048", "mixed 8", "mixed 16", "mixed 64"]
    print(markdown_table(["file", "MB", "protocol", "ours / llama.cpp: " + ", ".join(keys), "ours of bandwidth limit",
                          "llama.cpp of bandwidth limit", "peak RSS ours / llama.cpp (GB)",
                          "ours: peak RSS / (file + KV)", "greedy = llama.cpp"], rows))
    print("\n(ratios > 1: ours faster; TTFT ratios are llama.cpp's time / ours; '-': not in that protocol)\n")
    print(markdown_table(["file", "figure", "ours", "llama.cpp", "ours / llama.cpp"], details))
    return {"l3_bytes": l3, "read_bandwidth_bytes_s": bandwidth, "threads": threads, "quantization": quantization,
            "files": results}


def figures(label: str, r: dict) -> list[list]:
    """Rows of the per-file table: each figure on each side and the ratio (> 1: ours better)."""
    ours, lc = r["ours"], r["llama.cpp"]
    if "error" in ours or "error" in lc:
        return [[label, "error", ours.get("error", "ok")[:80], lc.get("error", "ok")[:80], "-"]]
    rows = [[label, "threads", ours["threads"], lc["threads"], "-"],
            [label, "load s (warm page cache)", fmt(ours["load_s"]), fmt(lc["load_s"]), fmt(lc["load_s"] / ours["load_s"])],
            [label, "decode tok/s, one stream", fmt(ours["decode_tok_s"], 1), fmt(lc["decode_tok_s"], 1),
             fmt(ours["decode_tok_s"] / lc["decode_tok_s"])]]
    for key, what in (("ttft_512_s", "TTFT 512 tokens s"), ("ttft_2048_s", "TTFT 2,048 tokens s")):
        if key in ours:
            rows.append([label, what, fmt(ours[key]), fmt(lc[key]), fmt(lc[key] / ours[key])])
    for num in (8, 16, 64):
        if f"mixed_{num}_tok_s" in ours:
            a, b = ours[f"mixed_{num}_tok_s"], lc[f"mixed_{num}_tok_s"]
            rows.append([label, f"{num} mixed requests tok/s", fmt(a, 1), fmt(b, 1), fmt(a / b)])
    rows.append([label, "peak RSS GB (after imports)", f"{ours['peak_rss_bytes'] / 1e9:.2f} "
                 f"({ours['import_rss_bytes'] / 1e9:.2f})", f"{lc['peak_rss_bytes'] / 1e9:.2f} "
                 f"({lc['import_rss_bytes'] / 1e9:.2f})", fmt(lc["peak_rss_bytes"] / ours["peak_rss_bytes"])])
    for i, a in enumerate(r.get("agreement", [])):
        part = "none" if a["first_parting"] is None else a["first_parting"]
        rows.append([label, f"chat prompt {i + 1}: greedy tokens equal", f"{a['equal']}/{a['of']}",
                     f"first parting at {part}", "-"])
    return rows


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
