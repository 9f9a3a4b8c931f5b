"""Input workers prepare requests concurrently (issue 16): image chat prompts processed from
several threads at once give exactly the ids, images and positions of one-at-a-time
processing (the shared tokenizer's per-call settings would otherwise race: "Already
borrowed", or user text split with the template's setting)."""

from __future__ import annotations

import base64
import threading

import pytest

from atlas_vlm import LLM, SamplingParams
from helpers import IMAGES

pytestmark = pytest.mark.vlm

PHOTOS = ["grace_hopper.jpg", "rocket.jpg", "chelsea.png", "coffee.png"]


def prompt(i: int, name: str) -> dict:
    mime = "image/png" if name.endswith(".png") else "image/jpeg"
    uri = f"data:{mime};base64," + base64.b64encode((IMAGES / name).read_bytes()).decode()
    return {"messages": [{"role": "user", "content": [
        {"type": "image", "image": uri}, {"type": "text", "text": f"Question {i}: <|im_start|> what is this?"}]}]}


def test_concurrent_preparation_equals_serial(tiny_models):
    llm = LLM(str(tiny_models["qwen2_5_vl"][0]), max_model_len=1024, kv_cache_memory=32 << 20,
              max_pixels=64 * 28 * 28, dtype="float32")
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=2)
    prompts = [prompt(i, PHOTOS[i % len(PHOTOS)]) for i in range(12)]
    serial = [engine.process_request(p, params, f"s{i}") for i, p in enumerate(prompts)]
    results, errors = [None] * len(prompts), []

    def work(k):
        for i in range(k, len(prompts), 4):
            try:
                results[i] = engine.process_request(prompts[i], params, f"c{i}")
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    for a, b in zip(serial, results, strict=True):
        assert b.token_ids == a.token_ids
        assert [s.length for s in b.mm_positions] == [s.length for s in a.mm_positions]
        assert bool((b.mrope_positions == a.mrope_positions).all())
    # the user's "<|im_start|>" stays text (split), the template's is the special token
    im_start = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert serial[0].token_ids.count(im_start) == 3  # the default system, user and assistant turns only
