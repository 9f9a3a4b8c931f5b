"""HTTP serving benchmark: open-loop Poisson load against ``atlas-vlm serve`` and
``transformers serve`` on the same model folder, plus our offline ``LLM.chat`` on the same
requests.

Requests: a fixed seed per rate draws fresh prompts of 8..160 random words and output limits of 16..64
tokens (greedy, streamed; ``transformers serve`` has no ``ignore_eos``, so outputs may end
at EOS and every system is credited with the tokens it actually streamed). Arrivals are a
Poisson process at each rate (requests/s; ``inf``: all at once), the same arrival times for
every system. Each run is bounded in count and wall time; unfinished requests are
reported as failures. Servers get ``OMP_NUM_THREADS`` = this process's torch thread count
(``scripts/bench.py --threads N``), so all three systems use the same number of threads.

Metrics (seconds): throughput = output tokens / (last token - first arrival); TTFT =
first content chunk - send; ITL = gaps between content chunks of one request; p50/p99
over all requests (TTFT) or all gaps (ITL). Each server runs alone (sequentially), as a
subprocess, with the same torch thread count.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import log, markdown_table, section, text_model_paths

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "  # noqa: SIM905
         "government company number group problem fact river mountain city music story light water").split()


def make_requests(num: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 160)))
        reqs.append({"messages": [{"role": "user", "content": f"Request {i}. Summarise: {words}"}],
                     "max_tokens": rng.randint(16, 64)})
    return reqs


def arrivals(num: int, rate: float, seed: int = 1) -> list[float]:
    """Poisson arrival offsets (seconds from the start) at ``rate`` requests/s."""
    if rate == float("inf"):
        return [0.0] * num
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def _one(client, url: str, model: str, req: dict, delay: float, t0: float) -> dict:
    import json

    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    sent, times = time.perf_counter(), []
    body = {"model": model, "messages": req["messages"], "max_tokens": req["max_tokens"], "temperature": 0,
            "stream": True}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}"}
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"error": f"{type(e).__name__}: {e}"}
    return {"sent": sent, "times": times}


async def _load(url: str, model: str, reqs: list[dict], offsets: list[float], timeout_s: float) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=len(reqs))) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, url, model, r, d, t0)) for r, d in zip(reqs, offsets)]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
    results = [t.result() for t in done if not t.cancelled()]
    ok = [r for r in results if r.get("times")]
    tokens = sum(len(r["times"]) for r in ok)
    end = max((r["times"][-1] for r in ok), default=t0)
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {"ok": len(ok), "failed": len(reqs) - len(ok), "output_tokens": tokens,
            "tok_s": tokens / (end - t0) if ok else 0.0, "ttft_p50": _percentile(ttft, 50),
            "ttft_p99": _percentile(ttft, 99), "itl_p50": _percentile(itl, 50), "itl_p99": _percentile(itl, 99)}


def _start(cmd: list[str], url: str, model: str, timeout_s: float = 300) -> subprocess.Popen:
    """Start a server and wait until one tiny chat request is answered (bounded)."""
    import httpx
    import torch

    # the same intra-op thread count as this process (scripts/bench.py --threads): on a shared CPU,
    # OpenMP spin-waits with more threads than free cores slow small ops many times over
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + timeout_s
    probe = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}")
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=probe, timeout=60) as r:
                if r.status_code == 200 and any(line == "data: [DONE]" or '"finish_reason": "' in line
                                                or '"finish_reason":"' in line for line in r.iter_lines()):
                    return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    _stop(proc)
    raise TimeoutError(f"{cmd[:3]} did not answer within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_system(name, cmd, url, model, reqs_per_rate, rates, timeout_s) -> dict:
    log(f"{name}: starting")
    try:
        proc = _start(cmd, url, model)
    except (RuntimeError, TimeoutError, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        out = {}
        for rate, reqs in zip(rates, reqs_per_rate):
            log(f"{name}: rate {rate} req/s")
            m = out[str(rate)] = asyncio.run(_load(url, model, reqs, arrivals(len(reqs), rate), timeout_s))
            log(f"{name}: rate {rate}: {m['ok']} ok, {m['tok_s']:.1f} tok/s, TTFT p50/p99 {m['ttft_p50']:.2f}/"
                f"{m['ttft_p99']:.2f} s, ITL p50/p99 {1000 * m['itl_p50']:.0f}/{1000 * m['itl_p99']:.0f} ms")
        return out
    finally:
        _stop(proc)


def compare_servers(ours_model: str, hf_model: str, served_name: str, max_model_len: int, reqs_per_rate: list,
                    rates: list[float], timeout_s: float) -> dict:
    """``atlas-vlm serve`` on ``ours_model`` and ``transformers serve`` on ``hf_model`` (a folder
    with the same weights), both fp32 on CPU, started one after the other on a free port and
    given the same load; ``{"ours": per-rate figures, "transformers serve": ...}`` (or
    ``{"error": ...}`` for a server that would not start)."""
    port = _free_port()
    ours_cmd = [sys.executable, "-m", "atlas_vlm.serve", ours_model, "--port", str(port), "--max-model-len",
                str(max_model_len), "--served-model-name", served_name, "--log-level", "warning", "--dtype", "float32"]
    results = {"ours": _run_system("atlas-vlm serve", ours_cmd, f"http://127.0.0.1:{port}", served_name,
                                   reqs_per_rate, rates, timeout_s)}
    port = _free_port()
    cli = Path(sys.executable).with_name("transformers")  # the venv's console script, on PATH or not
    hf_cmd = [str(cli) if cli.exists() else "transformers", "serve", "--device", "cpu", "--force_model", hf_model,
              "--port", str(port), "--dtype", "float32"]
    results["transformers serve"] = _run_system("transformers serve", hf_cmd, f"http://127.0.0.1:{port}", hf_model,
                                                reqs_per_rate, rates, timeout_s)
    return results


def _offline(gguf: str, reqs: list[dict]) -> dict:
    from atlas_vlm import LLM, SamplingParams

    llm = LLM(gguf, dtype="float32", max_model_len=1024)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in reqs]
    warm = make_requests(2, seed=999)  # other prompts: the measured ones must not hit the prefix cache
    llm.chat([r["messages"] for r in warm], [SamplingParams(temperature=0, max_tokens=4)] * 2, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.chat([r["messages"] for r in reqs], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def run(quick: bool = False) -> dict:
    """Run the HTTP serving section; print its table; return the numbers."""
    num, rates, timeout_s = (16, [2.0, float("inf")], 300) if quick else (48, [1.0, 4.0, float("inf")], 900)
    gguf, folder = text_model_paths()
    # fresh prompts per rate (seeded): a repeated prompt would hit the prefix cache of the previous rate
    reqs_per_rate = [make_requests(num, seed=100 + k) for k in range(len(rates))]
    section(f"HTTP serving: {num} chat requests (8..160 words, 16..64 output tokens, greedy, streamed), Poisson "
            f"arrivals at {rates} req/s, SmolLM2-135M fp32")
    results = compare_servers(gguf, str(folder), "smollm2", 1024, reqs_per_rate, rates, timeout_s)
    log("offline LLM.chat on the requests of the last rate")
    results["offline"] = _offline(gguf, reqs_per_rate[-1])
    rows = []
    for system in ("ours", "transformers serve"):
        r = results[system]
        if "error" in r:
            rows.append([system, "-", "-", "-", "-", "-", "-", "failed: " + r["error"][:60]])
            continue
        for rate, m in r.items():
            rows.append([system, rate, f"{m['ok']}/{num}", f"{m['tok_s']:.1f}", f"{m['ttft_p50']:.2f}",
                         f"{m['ttft_p99']:.2f}", f"{1000 * m['itl_p50']:.0f} / {1000 * m['itl_p99']:.0f}", ""])
    off = results["offline"]
    rows.append([f"offline LLM.chat (all at once, the rate-{rates[-1]} requests)", "-", f"{num}/{num}", f"{off['tok_s']:.1f}", "-", "-", "-", ""])
    print(markdown_table(["system", "rate (req/s)", "finished", "output tok/s", "TTFT p50 s", "TTFT p99 s",
                          "ITL p50 / p99 ms", "note"], rows))
    inf = str(float("inf"))
    if "error" not in results["ours"]:
        ratio = results["ours"][inf]["tok_s"] / off["tok_s"]
        print(f"\nours at rate {rates[-1]} / offline on the same requests = {ratio:.2f} (target >= 0.90)")
        hf = results["transformers serve"]
        if "error" not in hf and hf[inf]["tok_s"] > 0:
            print(f"ours / transformers serve at rate inf = {results['ours'][inf]['tok_s'] / hf[inf]['tok_s']:.2f} "
                  f"(target >= 2)")
    from benchmarks import server_vlm  # the image mix on the VLM, same load shape

    results["image_mix"] = server_vlm.run(quick=quick)
    return results
