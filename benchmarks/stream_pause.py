"""How long other streams pause while one heavy input is processed (issue 16).

Starts ``atlas-vlm serve`` on the embedded random-weight Qwen2.5-VL (from ``--repo``, so the
same script measures an older checkout: ``--repo /path/to/old/worktree``), opens
``--streams`` long greedy completion streams, and records when each SSE event arrives. Then,
one at a time, it sends a heavy request and reports the longest gap between two events of
any of the other streams while it was in flight, against the same figure over a quiet
window of the same length:

- a chat request with one 9000x9000 PNG (a ``data:`` URI; decode + resize + patchify);
- a completions request with a 1 MB text prompt (tokenized, then refused as too long).

``python -m benchmarks.stream_pause [--repo DIR] [--streams 4] [--threads 1]``; prints one
table (seconds). Not a test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def big_png(side: int = 9000) -> bytes:
    """A ``side`` x ``side`` RGB PNG that compresses well (a stretched gradient), so the
    request is small and the decoding is what costs."""
    from PIL import Image

    img = Image.merge("RGB", [Image.linear_gradient("L").resize((side, side)),
                              Image.linear_gradient("L").rotate(90).resize((side, side)),
                              Image.new("L", (side, side), 128)])
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def big_prompt(n_bytes: int = 1 << 20) -> str:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
    parts, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n_bytes]


async def _stream(client, name, stamps: list, stop: asyncio.Event):
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 3500, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                stamps.append(time.monotonic())
            if stop.is_set():
                return


def max_gap(all_stamps: list[list[float]], t0: float, t1: float) -> float:
    """Longest interval between consecutive events of one stream that overlaps [t0, t1]."""
    best = 0.0
    for stamps in all_stamps:
        for a, b in zip(stamps, stamps[1:]):
            if b >= t0 and a <= t1:
                best = max(best, b - a)
    return best


async def measure(url: str, name: str, streams: int) -> list[tuple[str, float, float, float, int]]:
    png = big_png()
    image = "data:image/png;base64," + base64.b64encode(png).decode()
    prompt = big_prompt()
    heavy = {
        "9000x9000 PNG (%.1f MB)" % (len(png) / 1e6): ("/v1/chat/completions", {
            "model": name, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe."}]}]}),
        "1 MB text prompt": ("/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 1}),
    }
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        stamps = [[] for _ in range(streams)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_stream(client, name, s, stop)) for s in stamps]
        while min(len(s) for s in stamps) < 20:  # all streams decoding
            await asyncio.sleep(0.1)
        for label, (route, body) in heavy.items():
            q0 = time.monotonic()
            await asyncio.sleep(3.0)
            quiet = max_gap(stamps, q0, time.monotonic())
            t0 = time.monotonic()
            r = await client.post(route, json=body)
            t1 = time.monotonic()
            await asyncio.sleep(0.5)
            rows.append((label, t1 - t0, quiet, max_gap(stamps, t0, t1), r.status_code))
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(REPO), help="checkout whose server is measured (default: this one)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    args = ap.parse_args(argv)
    from atlas_vlm.default_models import default_vlm_model

    model, port, name = default_vlm_model(), _free_port(), "vlm"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": args.repo}
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "atlas_vlm.serve", str(model), "--port", str(port),
                             "--served-model-name", name, "--max-pixels", str(256 * 28 * 28), "--max-image-bytes",
                             "64MiB", "--max-model-len", "4096", "--kv-cache-memory", "512MiB", "--dtype", "float32",
                             "--log-level", "warning"], cwd=args.repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise SystemExit(f"server did not start: {log.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rows = asyncio.run(measure(url, name, args.streams))
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"repo {args.repo}; {args.streams} greedy streams; server OMP_NUM_THREADS={args.threads}")
    print("| heavy request | its latency s | other streams' longest gap, quiet s | while it ran s | status |")
    print("|---|---|---|---|---|")
    for label, latency, quiet, during, status in rows:
        print(f"| {label} | {latency:.2f} | {quiet:.2f} | {during:.2f} | {status} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
