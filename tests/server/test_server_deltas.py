"""The server's routes on DELTA / FINAL_ONLY outputs (issue 24), on the embedded SmolLM2:
a streamed answer (several prompts, ``n = 2``, a stop string, logprobs) joins to exactly the
whole answer, with the same usage (and, with ``continuous_usage_stats``, every chunk's usage
counts the tokens so far); the ``/metrics`` token counts and time-to-first-token of a
whole (FINAL_ONLY) answer count every generated token."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.server, pytest.mark.text]

PROMPTS = ["1, 2, 3, 4,", "The capital of France is"]


def test_streamed_completions_join_to_the_whole_answer(text_server):
    client = text_server.client()
    args = dict(model="smollm2", prompt=PROMPTS, max_tokens=12, temperature=0, n=2, stop=[" 7"], logprobs=2)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert len(whole.choices) == 4 and whole.choices[0].finish_reason == "stop"  # " 7" ended the count
    for c in whole.choices:
        parts = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(p.text for p in parts) == c.text and parts[-1].finish_reason == c.finish_reason
        streamed = [lp for p in parts if p.logprobs for lp in p.logprobs.token_logprobs]
        assert streamed == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)
        offsets = [o for p in parts if p.logprobs for o in p.logprobs.text_offset]
        assert offsets == c.logprobs.text_offset  # offsets run on across the chunks
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices)


def test_streamed_chat_n2_joins_to_the_whole_answer(text_server):
    client = text_server.client()
    args = dict(model="smollm2", messages=[{"role": "user", "content": "Count from one to ten."}], max_tokens=10,
                temperature=0, n=2, logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    for c in whole.choices:
        parts = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(p.delta.content or "" for p in parts) == c.message.content
        tokens = [e.token for p in parts if p.logprobs for e in p.logprobs.content]
        assert tokens == [e.token for e in c.logprobs.content]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_continuous_usage_stats_count_the_tokens_so_far_on_every_chunk(text_server):
    client = text_server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = list(client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Count to 20."}],
                                               max_tokens=7, temperature=0, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    text = list(client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=7, temperature=0,
                                          stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    for chunks in (chat, text):
        counts = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in chunks]
        prompt = counts[-1][0]
        assert all(p == prompt and t == p + n for p, n, t in counts) and prompt > 0
        assert [n for _, n, _ in counts] == sorted(n for _, n, _ in counts) and counts[0][1] >= 1
        assert counts[-2][1] == counts[-1][1] == 7 and not chunks[-1].choices  # the last: the usage chunk


def test_metrics_count_every_token_of_a_whole_answer(text_server):
    before = text_server.metrics()
    r = text_server.client().completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=9, temperature=0,
                                                extra_body={"ignore_eos": True})
    after = text_server.metrics()
    assert r.usage.completion_tokens == 9
    assert after["atlas:generation_tokens_total"] - before.get("atlas:generation_tokens_total", 0) == 9
    assert after["atlas:time_to_first_token_seconds_count"] - before.get("atlas:time_to_first_token_seconds_count",
                                                                          0) == 1
    # 8 gaps between 9 tokens, each one observed (not one lump at the end)
    assert after["atlas:inter_token_latency_seconds_count"] - before.get("atlas:inter_token_latency_seconds_count",
                                                                          0) == 8
