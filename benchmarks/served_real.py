"""The real file as served (issue 34): ``atlas-vlm serve`` on Qwen2.5-Coder-1.5B-Instruct Q4_K_M
(``benchmarks.real_file``), started on 127.0.0.1 three times, one after another, at the same
thread count (``OMP_NUM_THREADS`` = this process's torch threads): default KV, ``--kv-cache-dtype
int8``, and ``--speculative ngram``.

Measured per server, on one streamed greedy chat request at a time (warm-up once, best of 2):
decode tok/s = (completion tokens - 1) / (last content chunk - first content chunk), the token
count from the final usage chunk (a speculative chunk may carry several tokens). KV: a free
answer of exactly ``N`` tokens (128, ``ignore_eos``), int8 over default (target >= 0.95x).
Speculation: a copy-heavy edit, a 41-line function returned whole with one variable renamed
(``EDIT``; up to 640 tokens, ends at EOS), ngram over the default server (target >= 2x), with
the draft acceptance from ``/metrics`` (accepted / proposed draft tokens over the request) and
whether both answers are the same text (greedy: they must be). Threads per side: the count
given, and the cores the server process really kept busy over the measured request (CPU seconds
from ``/proc/PID/stat`` over wall seconds). Each server start and request is bounded in time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import real_file
from benchmarks.common import fmt, log, markdown_table, section
from benchmarks.server import _free_port, _start, _stop

FUNCTION = "\n".join([
    "def summarize_orders(orders, tax_rate, discounts):",
    '    """Totals per customer, with tax and discounts applied."""',
    "    totals = {}",
    "    counts = {}",
    "    for order in orders:",
    "        customer = order['customer']",
    "        amount = 0.0",
    "        for item in order['items']:",
    "            price = item['price']",
    "            quantity = item['quantity']",
    "            if quantity <= 0:",
    "                continue",
    "            amount += price * quantity",
    "        code = order.get('discount_code')",
    "        if code in discounts:",
    "            rate = discounts[code]",
    "            amount = amount * (1.0 - rate)",
    "        amount = amount * (1.0 + tax_rate)",
    "        totals[customer] = totals.get(customer, 0.0) + amount",
    "        counts[customer] = counts.get(customer, 0) + 1",
    "    report = []",
    "    for customer in sorted(totals):",
    "        total = round(totals[customer], 2)",
    "        average = round(total / counts[customer], 2)",
    "        line = {",
    "            'customer': customer,",
    "            'orders': counts[customer],",
    "            'total': total,",
    "            'average': average,",
    "        }",
    "        report.append(line)",
    "    report.sort(key=lambda r: r['total'], reverse=True)",
    "    best = report[0]['customer'] if report else None",
    "    grand_total = 0.0",
    "    for line in report:",
    "        grand_total += line['total']",
    "    return {",
    "        'report': report,",
    "        'best_customer': best,",
    "        'grand_total': round(grand_total, 2),",
    "    }",
])
EDIT = ("Rename the variable `amount` to `order_amount` in this Python function. Return the whole function, "
        f"otherwise unchanged, in one code block, and nothing else.\n\n```python\n{FUNCTION}\n```")
FREE = "Explain the difference between a process and a thread, and when a program should use each."
MODEL = "coder"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included) from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith("#") and line.split()[0].split("{")[0] in (name, name + "_total"):
            return float(line.split()[-1])
    return 0.0


def _request(url: str, pid: int, content: str, max_tokens: int, ignore_eos: bool) -> dict:
    """One streamed greedy chat request: decode tok/s, tokens, text, cores busy."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    times, text, tokens = [], [], 0
    cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
                text.append(chunk["choices"][0]["delta"]["content"])
    cores = (_cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)
    return {"decode_tok_s": (tokens - 1) / (times[-1] - times[0]), "tokens": tokens, "text": "".join(text),
            "cores_busy": cores}


def _serve(path: str, name: str, extra: list[str], quantization: str | None, jobs: dict, quick: bool) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "atlas_vlm.serve", path, "--port", str(port), "--host", "127.0.0.1",
           "--max-model-len", "4096", "--served-model-name", MODEL, "--log-level", "warning", *extra,
           *(["--quantization", quantization] if quantization else [])]
    log(f"served: {name}: starting")
    t0 = time.perf_counter()
    try:
        proc = _start(cmd, url, MODEL, timeout_s=600)
    except (RuntimeError, TimeoutError, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"start_s": time.perf_counter() - t0, "threads": torch.get_num_threads()}
    try:
        for job, (content, max_tokens, ignore_eos) in jobs.items():
            log(f"served: {name}: {job}")
            drafts0 = _metric(url, "atlas:spec_decode_num_draft_tokens")
            accepted0 = _metric(url, "atlas:spec_decode_num_accepted_tokens")
            _request(url, proc.pid, content, max_tokens, ignore_eos)  # warm-up
            r = max((_request(url, proc.pid, content, max_tokens, ignore_eos) for _ in range(1 if quick else 2)),
                    key=lambda x: x["decode_tok_s"])
            drafts = _metric(url, "atlas:spec_decode_num_draft_tokens") - drafts0
            r["acceptance"] = (_metric(url, "atlas:spec_decode_num_accepted_tokens") - accepted0) / drafts \
                if drafts else None
            out[job] = r
        return out
    finally:
        _stop(proc)


def run(quick: bool = False, quantization: str | None = None, path: str | None = None) -> dict:
    """Run the section; print its table; return the numbers (tok/s, ratios, cores). ``path``:
    another model to serve instead of the real file (a smoke run on a small one)."""
    section(f"{Path(path).name if path else 'The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M'} as served: int8 vs "
            "default KV, ngram vs one stream")
    if path is None and not real_file.is_correct(real_file.default_path()):
        why = f"real file absent at {real_file.default_path()} (bash scripts/setup.sh --bench)"
        print(f"skipped: {why}")
        return {"skipped": why}
    path = path or str(real_file.default_path())
    n = 64 if quick else 128
    free, edit = (FREE, n, True), (EDIT, 640, False)
    res = {"threads": torch.get_num_threads(), "quantization": quantization, "model": path}
    for key, name, extra, jobs in (("default", "default KV", [], {"free": free, "edit": edit}),
                                   ("int8", "--kv-cache-dtype int8", ["--kv-cache-dtype", "int8"], {"free": free}),
                                   ("ngram", "--speculative ngram", ["--speculative", "ngram"], {"edit": edit})):
        res[key] = _serve(path, name, extra, quantization, jobs, quick)
    rows = []
    for label, base, other, job, goal in (("--kv-cache-dtype int8 / default KV", "default", "int8", "free", 0.95),
                                          ("--speculative ngram / one stream (edit)", "default", "ngram", "edit", 2.0)):
        a, b = res[base], res[other]
        if "error" in a or "error" in b:
            rows.append([label, "-", "-", "-", "-", f"failed: {(a.get('error') or b.get('error'))[:80]}"])
            continue
        x, y = a[job], b[job]
        ratio = y["decode_tok_s"] / x["decode_tok_s"]
        note = f"{y['tokens']} / {x['tokens']} tokens, same text: {x['text'] == y['text']}"
        if y.get("acceptance") is not None:
            note += f", drafts accepted {y['acceptance']:.0%}"
        res[f"{other}_ratio"] = ratio
        rows.append([label, f"{fmt(x['decode_tok_s'], 1)} / {fmt(y['decode_tok_s'], 1)}", f"{fmt(ratio)}x "
                     f"(target >= {goal}x)", f"{a['threads']} / {b['threads']}",
                     f"{fmt(x['cores_busy'], 1)} / {fmt(y['cores_busy'], 1)}", note])
    print(markdown_table(["servers", "decode tok/s (base / other)", "ratio", "threads given (base / other)",
                          "cores busy (base / other)", "note"], rows))
    return res
