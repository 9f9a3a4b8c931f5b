"""The server on the embedded SmolLM2 (real weights) against the in-process ``LLM`` on the
same model and settings: greedy chat and completions token for token, streaming, usage,
logprobs, seeded sampling, stop strings, ``n`` sharing the prompt's blocks, vLLM's chat
template switches, 32 concurrent clients batched together, and a mid-stream disconnect
giving every block back."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from atlas_vlm import SamplingParams

pytestmark = [pytest.mark.server, pytest.mark.text]

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Say hello in Spanish."]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_greedy_equals_llm_chat_with_exact_usage(text_server, text_llm):
    client = text_server.client()
    refs = text_llm.chat([user(q) for q in QUESTIONS[:2]], greedy(12), use_tqdm=False)
    for q, ref in zip(QUESTIONS, refs):
        r = client.chat.completions.create(model="smollm2", messages=user(q), max_tokens=12, temperature=0)
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    # the same question again: its full prompt blocks come from the prefix cache
    again = client.chat.completions.create(model="smollm2", messages=user(QUESTIONS[0]), max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16


def test_completions_equal_generate_for_text_token_ids_and_lists(text_server, text_llm):
    client = text_server.client()
    ids = text_llm.tokenizer("Once upon a time")["input_ids"]
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    refs = text_llm.generate(prompts + [ids], greedy(8), use_tqdm=False)
    r = client.completions.create(model="smollm2", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in refs[:2]]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs[:2])
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in refs[:2])
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == refs[2].text and r.usage.prompt_tokens == len(ids)
    r = client.completions.create(model="smollm2", prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == text_llm.generate(
        ids, greedy(3), use_tqdm=False)[0].text


def test_stream_concatenates_to_the_full_text_with_usage(text_server):
    client = text_server.client()
    full = client.chat.completions.create(model="smollm2", messages=user(QUESTIONS[1]), max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="smollm2", messages=user(QUESTIONS[1]), max_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # the raw wire: SSE "data: {...}" events ending in "data: [DONE]"
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", text_server.url + "/v1/completions", json=body, timeout=120) as resp:
        events = [line for line in resp.iter_lines() if line]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_logprobs_equal_the_library(text_server, text_llm):
    ref = text_llm.chat(user(QUESTIONS[0]), greedy(6, logprobs=3), use_tqdm=False)[0]
    r = text_server.client().chat.completions.create(model="smollm2", messages=user(QUESTIONS[0]), max_tokens=6,
                                                     temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(ref.logprobs, abs=1e-4)
    assert "".join(e.token for e in content) == ref.text
    for e, top in zip(content, ref.top_logprobs):
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(sorted(top.values(), reverse=True), abs=1e-4)
    c = text_server.client().completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 3 and all(len(t) == 2 for t in c.choices[0].logprobs.top_logprobs)


def test_seeded_sampling_and_stop_strings_equal_the_library(text_server, text_llm):
    client = text_server.client()
    ref = text_llm.chat(user(QUESTIONS[2]), SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=123,
                                                           max_tokens=8), use_tqdm=False)[0]
    r = client.chat.completions.create(model="smollm2", messages=user(QUESTIONS[2]), max_tokens=8, temperature=0.9,
                                       top_p=0.9, seed=123, extra_body={"top_k": 40})
    assert r.choices[0].message.content == ref.text
    ref = text_llm.generate("1, 2, 3, 4,", greedy(12, stop=[" 7", "x"]), use_tqdm=False)[0]
    r = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7", "x"])
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop" and " 7" not in ref.text


def test_n_choices_share_the_prompt_blocks(text_server, text_llm):
    question = "List the planets of the solar system in order from the sun, with one fact about each. " * 2
    ref = text_llm.chat(user(question), greedy(8), use_tqdm=False)[0]
    before = text_server.metrics()
    r = text_server.client().chat.completions.create(model="smollm2", messages=user(question), max_tokens=8,
                                                     temperature=0, n=3)
    after = text_server.metrics()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == ref.text for c in r.choices)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 3 * len(ref.token_ids)
    full_blocks = (len(ref.prompt_token_ids) - 1) // 16 * 16
    assert after["atlas:prefix_cache_hits_total"] - before["atlas:prefix_cache_hits_total"] >= 2 * full_blocks > 0
    chunks = text_server.client().chat.completions.create(model="smollm2", messages=user(question), max_tokens=8,
                                                          temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == {0: ref.text, 1: ref.text}


def test_vllm_add_generation_prompt_and_continue_final_message(text_server, text_llm):
    tok = text_llm.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    expected = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True, tokenize=True, return_dict=False)
    client = text_server.client()
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    ref = text_llm.generate({"messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
                            greedy(8), use_tqdm=False)[0]
    assert r.usage.prompt_tokens == len(expected)
    assert ref.prompt_token_ids == list(expected) and r.choices[0].message.content == ref.text
    no_gen = tok.apply_chat_template(user(QUESTIONS[0]), add_generation_prompt=False, tokenize=True, return_dict=False)
    r = client.chat.completions.create(model="smollm2", messages=user(QUESTIONS[0]), max_tokens=2, temperature=0,
                                       extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(no_gen)


def test_32_concurrent_clients_batch_together_and_match_offline(text_server, text_llm):
    prompts = [f"{i} plus {i % 7} equals" for i in range(32)]  # short raw prompts: cheap on 2 cores
    refs = text_llm.generate(prompts, greedy(6), use_tqdm=False)
    client = text_server.client()
    before, peak, done = text_server.metrics(), [0.0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], text_server.metrics()["atlas:num_requests_running"])
            time.sleep(0.05)

    def ask(p):
        return client.completions.create(model="smollm2", prompt=p, max_tokens=6, temperature=0).choices[0].text

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with ThreadPoolExecutor(max_workers=32) as pool:
            answers = list(pool.map(ask, prompts, timeout=600))
    finally:
        done.set()
        poller.join(timeout=60)
    after = text_server.metrics()
    assert answers == [o.text for o in refs]
    assert peak[0] > 1
    steps = after["atlas:num_requests_per_step_count"] - before["atlas:num_requests_per_step_count"]
    small = (after['atlas:num_requests_per_step_bucket{le=8.0}'] - before['atlas:num_requests_per_step_bucket{le=8.0}'])
    assert steps > small  # some steps ran more than 8 of the 32 requests at once


def test_disconnect_mid_stream_gives_every_block_back(text_server):
    start = text_server.metrics()
    assert start["atlas:num_kv_blocks_free"] == start["atlas:num_kv_blocks_total"]
    body = {"model": "smollm2", "messages": user("Tell me a very long story."), "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", text_server.url + "/v1/chat/completions", json=body, timeout=120) as resp:
        events = resp.iter_lines()
        got = [e for _, e in zip(range(6), events)]  # 3 events (with their blank separators)
    assert sum(e.startswith("data: ") for e in got) == 3
    deadline = time.monotonic() + 60  # a liveness bound, not a speed claim: the abort is asynchronous
    while time.monotonic() < deadline:
        m = text_server.metrics()
        if m["atlas:num_kv_blocks_free"] == start["atlas:num_kv_blocks_free"] and m["atlas:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert m["atlas:num_kv_blocks_free"] == start["atlas:num_kv_blocks_free"]
    assert m['atlas:request_success_total{finished_reason=abort}'] >= 1
    assert m["atlas:generation_tokens_total"] - start["atlas:generation_tokens_total"] < 400


def test_a_client_gone_during_a_non_streamed_request_aborts_it(text_server):
    start = text_server.metrics()
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and closes its connection
        httpx.post(text_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    deadline = time.monotonic() + 60  # a liveness bound: the server polls for the disconnect
    while time.monotonic() < deadline:
        m = text_server.metrics()
        if m['atlas:request_success_total{finished_reason=abort}'] > start.get(
                'atlas:request_success_total{finished_reason=abort}', 0):
            break
        time.sleep(0.05)
    assert m["atlas:num_kv_blocks_free"] == start["atlas:num_kv_blocks_free"]
    assert m["atlas:generation_tokens_total"] - start["atlas:generation_tokens_total"] < 400
