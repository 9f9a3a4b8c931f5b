"""The server with ``--speculative ngram``: a greedy completion equals the in-process engine
without drafts, and ``/metrics`` counts the drafts proposed and accepted."""

from __future__ import annotations

import pytest

from server_process import ServerProcess
from atlas_vlm import LLM, SamplingParams

pytestmark = [pytest.mark.server, pytest.mark.text]
PROMPT = "a b c d a b c d a b c d a b c"


def test_speculative_server_equals_plain_engine_and_counts_drafts(tiny_models):
    folder = tiny_models["qwen2"][0]
    ref = LLM(str(folder), num_kvcache_blocks=128, dtype="float32").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    server = ServerProcess(str(folder), "--dtype", "float32", "--num-kvcache-blocks", "128",
                           "--speculative", "ngram", "--num-speculative-tokens", "3")
    try:
        before = server.metrics()
        assert before["atlas:spec_decode_num_draft_tokens_total"] == 0
        r = server.client().completions.create(model="test-model", prompt=PROMPT, max_tokens=30, temperature=0,
                                               extra_body={"ignore_eos": True})
        after = server.metrics()
    finally:
        server.stop()
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    proposed = after["atlas:spec_decode_num_draft_tokens_total"]
    accepted = after["atlas:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= proposed
    assert 0 < after["atlas:spec_decode_num_drafts_total"] <= proposed
