"""HTTP serving benchmark, image mix: the same open-loop Poisson load as
``benchmarks.server`` on the embedded random-weight Qwen2.5-VL, one request in three carrying
an image (a real photo, pre-resized to at most 224 px so every system sees the same pixels,
sent as a ``data:`` URI), against ``atlas-vlm serve`` and ``transformers serve`` on the same
model folder. The model's words mean nothing (random weights): this measures the serving
path (image decode, vision tower, prefill with visual tokens, batching), not answers.
"""

from __future__ import annotations

import base64
import io
import random
import sys
from pathlib import Path

from benchmarks.common import log, markdown_table, section, vlm_model_path
from benchmarks.server import WORDS, compare_servers

PHOTOS = ("rocket.jpg", "chelsea.png", "coffee.png", "grace_hopper.jpg")
IMAGE_SHARE = 3  # every third request carries an image


def _data_uri(path: Path, max_side: int = 224) -> str:
    from PIL import Image

    img = Image.open(path).convert("RGB")
    img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_requests(num: int, seed: int, images_dir: Path) -> list[dict]:
    """``num`` chat requests (4..60 words, 8..32 output tokens); every ``IMAGE_SHARE``-th holds a photo."""
    rng = random.Random(seed)
    uris = [_data_uri(images_dir / name) for name in PHOTOS]
    reqs = []
    for i in range(num):
        text = f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
        content: str | list = text
        if i % IMAGE_SHARE == 0:
            content = [{"type": "image_url", "image_url": {"url": rng.choice(uris)}}, {"type": "text", "text": text}]
        reqs.append({"messages": [{"role": "user", "content": content}], "max_tokens": rng.randint(8, 32)})
    return reqs


def run(quick: bool = False) -> dict:
    """Run the image-mix serving section; print its table; return the numbers."""
    num, rates, timeout_s = (12, [float("inf")], 300) if quick else (36, [1.0, float("inf")], 900)
    folder = vlm_model_path()
    images_dir = Path(__file__).resolve().parent.parent / "tests" / "data" / "images"
    reqs_per_rate = [make_requests(num, seed=200 + k, images_dir=images_dir) for k in range(len(rates))]
    section(f"HTTP serving, image mix: {num} chat requests, 1 in {IMAGE_SHARE} with a photo (<= 224 px, data: URI), "
            f"Poisson arrivals at {rates} req/s, random-weight Qwen2.5-VL fp32 (words not meaningful)")
    results = compare_servers(folder, folder, "vlm", 2048, reqs_per_rate, rates, timeout_s)
    rows = []
    for system, r in results.items():
        if "error" in r:
            rows.append([system, "-", "-", "-", "-", "-", "-", "failed: " + r["error"][:60]])
            continue
        for rate, m in r.items():
            note = "" if m["ok"] == num else f"{m['failed']} failed"
            rows.append([system, rate, f"{m['ok']}/{num}", f"{m['tok_s']:.1f}", f"{m['ttft_p50']:.2f}",
                         f"{m['ttft_p99']:.2f}", f"{1000 * m['itl_p50']:.0f} / {1000 * m['itl_p99']:.0f}", note])
    print(markdown_table(["system", "rate (req/s)", "finished", "output tok/s", "TTFT p50 s", "TTFT p99 s",
                          "ITL p50 / p99 ms", "note"], rows))
    log("image mix done")
    return results


if __name__ == "__main__":  # python -m benchmarks.server_vlm [--quick]
    run(quick="--quick" in sys.argv)
