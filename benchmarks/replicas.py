"""Replicas benchmark: the same open-loop HTTP load against ``atlas-vlm serve``
with 1 replica (the plain server) and with 2 replicas on Ray Serve, routed least-loaded and
cache-aware.

Requests: chat requests that share long system prompts (4 prefixes of ~200 words, a short
distinct user question each; greedy, streamed, 16..32 output tokens), in a seeded shuffled
order, with Poisson arrivals (``benchmarks.server.arrivals``, the same times for every
system). Metrics: throughput, TTFT p50/p99 (as ``benchmarks.server``), and the prefix-cache
hit rate = prompt tokens served from the prefix cache / prompt tokens, summed over the
replicas' own ``atlas:prefix_cache_*`` counters in ``/metrics`` (deltas over the load).
On a 2-core machine two replicas (one core each) cannot be faster than one replica with two
cores; what the routing decides is the hit rate and with it the TTFT.
"""

from __future__ import annotations

import asyncio
import random
import sys

from benchmarks.common import log, markdown_table, section, text_model_paths
from benchmarks.server import WORDS, _free_port, _load, _start, _stop, arrivals


def make_requests(num: int, num_prefixes: int = 4, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    systems = [f"You are assistant {k}. Background: " + " ".join(rng.choice(WORDS) for _ in range(200))
               for k in range(num_prefixes)]
    reqs = [{"messages": [{"role": "system", "content": systems[i % num_prefixes]},
                          {"role": "user", "content": f"Question {i}: summarise the {rng.choice(WORDS)}."}],
             "max_tokens": rng.randint(16, 32)} for i in range(num)]
    rng.shuffle(reqs)
    return reqs


def _prefix_counters(url: str) -> tuple[float, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=60).text):
        for s in fam.samples:
            if s.name == "atlas:prefix_cache_hits_total":
                hits += s.value
            elif s.name == "atlas:prefix_cache_queries_total":
                queries += s.value
    return hits, queries


def _run(name: str, extra: list[str], gguf: str, reqs: list[dict], rate: float, timeout_s: float) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "atlas_vlm.serve", gguf, "--port", str(port), "--max-model-len", "1024",
           "--served-model-name", "smollm2", "--log-level", "warning", *extra]
    log(f"{name}: starting")
    try:
        proc = _start(cmd, url, "smollm2", timeout_s=600)
    except (RuntimeError, TimeoutError, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        h0, q0 = _prefix_counters(url)
        m = asyncio.run(_load(url, "smollm2", reqs, arrivals(len(reqs), rate), timeout_s))
        h1, q1 = _prefix_counters(url)
        m["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        log(f"{name}: {m['ok']} ok, {m['tok_s']:.1f} tok/s, TTFT p50/p99 {m['ttft_p50']:.2f}/{m['ttft_p99']:.2f} s, "
            f"prefix hit rate {m['prefix_hit_rate']:.3f}")
        return m
    finally:
        _stop(proc)


def run(quick: bool = False) -> dict:
    """Run the replicas section; print its table; return the numbers."""
    num, rate, timeout_s = (16, 1.0, 600) if quick else (48, 1.0, 1200)
    gguf, _ = text_model_paths()
    reqs = make_requests(num)
    section(f"Replicas: {num} chat requests sharing 4 system prompts (~200 words), 16..32 output tokens, greedy, "
            f"streamed, Poisson arrivals at {rate} req/s, SmolLM2-135M fp32")
    systems = {"1 replica": [],
               "2 replicas, least_loaded": ["--replicas", "2", "--routing", "least_loaded"],
               "2 replicas, cache_aware": ["--replicas", "2", "--routing", "cache_aware"]}
    results = {name: _run(name, extra, gguf, reqs, rate, timeout_s) for name, extra in systems.items()}
    rows = []
    for name, m in results.items():
        if "error" in m:
            rows.append([name, "-", "-", "-", "-", "-", "failed: " + m["error"][:60]])
            continue
        rows.append([name, f"{m['ok']}/{num}", f"{m['tok_s']:.1f}", f"{m['ttft_p50']:.2f}", f"{m['ttft_p99']:.2f}",
                     f"{m['prefix_hit_rate']:.3f}", ""])
    print(markdown_table(["system", "finished", "output tok/s", "TTFT p50 s", "TTFT p99 s", "prefix hit rate",
                          "note"], rows))
    return results
