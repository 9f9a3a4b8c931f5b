"""Qwen3 reasoning through the ``openai`` client: a tiny random Qwen3 (Qwen3's tokenizer and
thinking template) served in this process by uvicorn on a free 127.0.0.1 port (started and
stopped by the fixture), with ``reasoning_parser="qwen3"``. Random weights rarely think, so
an engine observer raises the logits of a fixed thought (``<think> let me see</think>``)
for the first tokens of every request; the grammar still decides everything after it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest

from server_process import free_port

pytestmark = [pytest.mark.server, pytest.mark.text]

SIMPLE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Is it ok? Answer in JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SIMPLE}}


@pytest.fixture(scope="module")
def thinking_server(tiny_models):
    import uvicorn
    from prometheus_client import CollectorRegistry

    from atlas_vlm.config import EngineConfig
    from atlas_vlm.engine import LLMEngine
    from atlas_vlm.engine.async_llm import AsyncLLM
    from atlas_vlm.entrypoints.openai.api_server import create_app
    from atlas_vlm.entrypoints.openai.media import MediaPolicy
    from atlas_vlm.entrypoints.openai.serving_common import ServerContext

    engine = LLMEngine(EngineConfig(model=str(tiny_models["qwen3"][0]), dtype="float32", max_model_len=1024,
                                    kv_cache_memory=32 << 20, reasoning_parser="qwen3"))
    rp = engine.reasoning_parser
    forced = [rp.start_token_id, *engine.tokenizer.encode(" let me see", add_special_tokens=False), rp.end_token_id]

    def force(chunks, inp, logits, sampled):
        for row, index in enumerate(sampled):
            k = chunks[index][0].num_output_tokens
            if k < len(forced):
                logits[row, forced[k]] += 1e4

    engine.runner.observers.append(force)
    front = AsyncLLM(engine)
    ctx = ServerContext(front, ["tiny-qwen3"], False, MediaPolicy(), engine.max_model_len,
                        reasoning_parser=rp)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ctx, CollectorRegistry()), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    import openai

    yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=20)
    front.shutdown()
    front.join(timeout=10)


def test_reasoning_split_with_a_grammar_after_it(thinking_server):
    r = thinking_server.chat.completions.create(model="tiny-qwen3", messages=ASK, max_tokens=80, temperature=1.0,
                                                seed=0, n=2, response_format=FORMAT)
    for ch in r.choices:
        msg = ch.message.model_dump()
        assert msg["reasoning_content"] == " let me see" and ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SIMPLE)
    stream = thinking_server.chat.completions.create(model="tiny-qwen3", messages=ASK, max_tokens=80,
                                                     temperature=1.0, seed=0, response_format=FORMAT, stream=True)
    reasoning, content, finish = "", "", None
    for chunk in stream:
        d = chunk.choices[0].delta.model_dump()
        reasoning += d.get("reasoning_content") or ""
        content += d.get("content") or ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == " let me see" and content == r.choices[0].message.content and finish == "stop"


def test_enable_thinking_false_has_no_reasoning(thinking_server):
    r = thinking_server.chat.completions.create(model="tiny-qwen3", messages=ASK, max_tokens=80, temperature=1.0,
                                                seed=1, response_format=FORMAT,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message.model_dump()
    assert msg.get("reasoning_content") is None
    assert "<think>" not in msg["content"]
    jsonschema.validate(json.loads(msg["content"]), SIMPLE)


def test_free_text_reasoning_and_answer(thinking_server):
    """No grammar: the thought is reasoning_content, the rest (random words) is content."""
    r = thinking_server.chat.completions.create(model="tiny-qwen3", messages=ASK, max_tokens=12, temperature=0)
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] == " let me see"
    assert "</think>" not in (msg["content"] or "") and r.usage.completion_tokens <= 12


def test_responses_reasoning_item_before_the_message(thinking_server):
    """/v1/responses: the thought is a ``reasoning`` item before the ``message``, whole and
    streamed (the reasoning item done before the message is added); the text equals chat's."""
    ask = dict(model="tiny-qwen3", input=ASK, max_output_tokens=30, temperature=0,
               text={"format": {"type": "json_schema", "name": "answer", "schema": SIMPLE}})
    r = thinking_server.responses.create(**ask)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == " let me see"
    jsonschema.validate(json.loads(r.output_text), SIMPLE)
    chat = thinking_server.chat.completions.create(model="tiny-qwen3", messages=ASK, max_tokens=30, temperature=0,
                                                   response_format=FORMAT)
    assert r.output_text == chat.choices[0].message.content
    events = list(thinking_server.responses.create(stream=True, **ask))
    items = [(e.type, e.item.type) for e in events if e.type.startswith("response.output_item.")]
    assert items == [("response.output_item.added", "reasoning"), ("response.output_item.done", "reasoning"),
                     ("response.output_item.added", "message"), ("response.output_item.done", "message")]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


def test_anthropic_messages_thinking_block_whole_and_streamed(thinking_server):
    """``/v1/messages``: the thought is a ``thinking`` block before the ``text`` block, the
    same whole and streamed (``thinking_delta`` then ``text_delta`` events, one block each)."""
    import anthropic

    c = anthropic.Anthropic(base_url=str(thinking_server.base_url).removesuffix("/").removesuffix("/v1"),
                            api_key="none", max_retries=0, timeout=120)
    ask = dict(model="tiny-qwen3", messages=ASK, max_tokens=12, extra_body={"temperature": 0})
    ref = thinking_server.chat.completions.create(model="tiny-qwen3", messages=ASK, max_tokens=12,
                                                  temperature=0).choices[0].message
    whole = c.messages.create(**ask)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == " let me see" and whole.content[1].text == ref.content
    events = list(c.messages.create(stream=True, **ask))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and e.index == 0)
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.index == 1)
    assert thought == " let me see" and text == ref.content
    assert [e.type for e in events].count("content_block_stop") == 2 and events[-1].type == "message_stop"
