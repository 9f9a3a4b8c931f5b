"""``atlas-vlm serve --kv-cache-dir``: prompt tokens loaded from the disk KV tier count in
``usage.prompt_tokens_details.cached_tokens`` and in ``/metrics`` (the prefix-cache hits and the
disk tier's own hits and bytes), also in a server restarted on the same folder; the answers
equal those of a server without the tier."""

from __future__ import annotations

import pytest

from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.text]

NAME = "tiny-qwen2"
BS = 16
LONG = "The quick brown fox jumps over the lazy dog. " * 12
OTHERS = [f"Another prompt, number {i}, about something else entirely. " * 10 for i in range(3)]


def start(tiny_models, *args) -> ServerProcess:
    return ServerProcess(str(tiny_models["qwen2"][0]), "--dtype", "float32", "--device", "cpu", "--num-kvcache-blocks",
                         "16", "--max-num-seqs", "1", *args, name=NAME)


def complete(server: ServerProcess, prompt: str):
    return server.client().completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)


def test_disk_hits_are_cached_tokens_and_metrics_also_after_a_restart(tiny_models, tmp_path):
    plain = start(tiny_models, "--no-enable-prefix-caching")
    try:
        ref = complete(plain, LONG)
    finally:
        plain.stop()
    full = (ref.usage.prompt_tokens - 1) // BS * BS
    server = start(tiny_models, "--kv-cache-dir", str(tmp_path), "--kv-cache-dir-max-gb", "1")
    try:
        first = complete(server, LONG)
        for p in OTHERS:  # evict LONG's blocks from the 16-block pool
            complete(server, p)
        before = server.metrics()
        again = complete(server, LONG)
        after = server.metrics()
    finally:
        server.stop()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == full > 0
    assert again.choices[0].text == first.choices[0].text == ref.choices[0].text
    assert again.choices[0].logprobs.token_logprobs == ref.choices[0].logprobs.token_logprobs
    assert after["atlas:kv_cache_disk_hits_total"] - before["atlas:kv_cache_disk_hits_total"] == full // BS
    assert after["atlas:prefix_cache_hits_total"] - before["atlas:prefix_cache_hits_total"] == full
    stored = sum(f.stat().st_size for f in tmp_path.rglob("*.kvb"))
    assert after["atlas:kv_cache_disk_bytes"] == stored > 0
    restarted = start(tiny_models, "--kv-cache-dir", str(tmp_path))
    try:
        r = complete(restarted, LONG)
        m = restarted.metrics()
    finally:
        restarted.stop()
    assert r.usage.prompt_tokens_details.cached_tokens == full and r.choices[0].text == ref.choices[0].text
    assert m["atlas:kv_cache_disk_hits_total"] == full // BS and m["atlas:kv_cache_disk_misses_total"] == 0
