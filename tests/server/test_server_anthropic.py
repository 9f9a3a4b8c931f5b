"""Anthropic's Messages API (``/v1/messages``) through the ``anthropic`` SDK on the text
server (embedded SmolLM2, greedy): the same tokens and prompt as chat completions on the
same request, stop sequences, ``max_tokens``, streaming events in Anthropic's order, a
tool-use round trip (forced with ``tool_choice`` any), ``count_tokens`` and errors in
Anthropic's JSON naming the field."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from test_server_structured import PARAMS, TOOLS

GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer has sampling arguments

pytestmark = [pytest.mark.server, pytest.mark.text]

SYSTEM = "You are a helpful assistant."
ASK = [{"role": "user", "content": "Name three colors of the rainbow."}]
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def client(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kwargs.pop("api_key", "none"), max_retries=0,
                               timeout=300, **kwargs)


def chat(server, n: int, **extra):
    return server.client().chat.completions.create(
        model="smollm2", messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=n, temperature=0,
        logprobs=True, **extra).choices[0]


def test_same_greedy_tokens_and_prompt_as_chat_completions(text_server):
    reply = client(text_server).messages.create(model="smollm2", system=SYSTEM, messages=ASK, max_tokens=24,
                                                **GREEDY)
    ref = text_server.client().chat.completions.create(
        model="smollm2", messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24, temperature=0)
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == "smollm2"
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == ref.choices[0].message.content
    assert reply.usage.input_tokens == ref.usage.prompt_tokens
    assert reply.usage.output_tokens == ref.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]
    assert reply.stop_reason == expected and reply.stop_sequence is None


def test_system_as_text_blocks_and_content_as_blocks_is_the_same_prompt(text_server):
    c = client(text_server)
    plain = c.messages.create(model="smollm2", system=SYSTEM, messages=ASK, max_tokens=6, **GREEDY)
    blocks = c.messages.create(model="smollm2", system=[{"type": "text", "text": SYSTEM}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}],
                               max_tokens=6, **GREEDY)
    assert blocks.usage.input_tokens == plain.usage.input_tokens
    assert blocks.content[0].text == plain.content[0].text


def test_max_tokens_stop_reason(text_server):
    reply = client(text_server).messages.create(model="smollm2", messages=ASK, max_tokens=3, **GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3


def test_stop_sequence_cuts_the_text_and_is_named(text_server):
    long = chat(text_server, 40)
    text = long.message.content
    words = [w for w in text.split() if len(w) > 3 and text.index(w) > 0]
    assert words, text
    stop = words[len(words) // 2]
    reply = client(text_server).messages.create(model="smollm2", system=SYSTEM, messages=ASK, max_tokens=40,
                                                **GREEDY, stop_sequences=["@@never@@", stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[:text.index(stop)]


def test_stream_events_in_order_and_same_text(text_server):
    c = client(text_server)
    whole = c.messages.create(model="smollm2", system=SYSTEM, messages=ASK, max_tokens=20, **GREEDY)
    events = list(c.messages.create(model="smollm2", system=SYSTEM, messages=ASK, max_tokens=20, **GREEDY,
                                    stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with c.messages.stream(model="smollm2", system=SYSTEM, messages=ASK, max_tokens=20, **GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_equals_usage_input_tokens(text_server):
    c = client(text_server)
    for extra in ({}, {"tools": A_TOOLS}):
        reply = c.messages.create(model="smollm2", system=SYSTEM, messages=ASK, max_tokens=1, **GREEDY, **extra)
        counted = c.messages.count_tokens(model="smollm2", system=SYSTEM, messages=ASK, **extra)
        assert counted.input_tokens == reply.usage.input_tokens > 0
    with_tools = c.messages.count_tokens(model="smollm2", system=SYSTEM, messages=ASK, tools=A_TOOLS)
    without = c.messages.count_tokens(model="smollm2", system=SYSTEM, messages=ASK)
    assert with_tools.input_tokens > without.input_tokens


def test_tool_use_round_trip_whole_and_streamed(text_server):
    c = client(text_server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    reply = c.messages.create(model="smollm2", messages=ask, max_tokens=120, **GREEDY, tools=A_TOOLS,
                              tool_choice=choice)
    assert reply.stop_reason == "tool_use"
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and u.id for u in uses)
    for u in uses:
        jsonschema.validate(u.input, PARAMS["get_weather"])
    with c.messages.stream(model="smollm2", messages=ask, max_tokens=120, **GREEDY, tools=A_TOOLS,
                           tool_choice=choice) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    # the results go back as tool messages: the same prompt as chat completions' tool turn
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "18 C, sunny"} for u in uses]
    turn = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                  {"role": "user", "content": results}]
    answer = c.messages.create(model="smollm2", messages=turn, max_tokens=8, **GREEDY, tools=A_TOOLS)
    calls = [{"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
             for u in uses]
    text = "".join(b.text for b in reply.content if b.type == "text") or None
    chat_turn = ask + [{"role": "assistant", "content": text, "tool_calls": calls},
                       *({"role": "tool", "tool_call_id": u.id, "content": "18 C, sunny"} for u in uses)]
    ref = text_server.client().chat.completions.create(model="smollm2", messages=chat_turn, max_tokens=8,
                                                       temperature=0, tools=TOOLS)
    assert answer.usage.input_tokens == ref.usage.prompt_tokens
    assert "".join(b.text for b in answer.content if b.type == "text") == (ref.choices[0].message.content or "")


def _error(e) -> dict:
    body = e.value.response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def test_errors_in_anthropic_shape_naming_the_field(text_server):
    c = client(text_server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="smollm2", messages=ASK, max_tokens=0)
    err = _error(e)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and "max_tokens" in err["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="smollm2", messages=ASK, max_tokens=4, extra_body={"frobnicate": 1})
    assert "'frobnicate' is not supported" in _error(e)["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="smollm2", messages=ASK, max_tokens=4, tool_choice={"type": "tool", "name": "nope"},
                          tools=A_TOOLS)
    assert "nope" in _error(e)["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    err = _error(e)
    assert err["type"] == "not_found_error" and "no-such-model" in err["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # missing max_tokens (the SDK insists on it)
        c.post("/v1/messages", body={"model": "smollm2", "messages": ASK}, cast_to=object)
    assert "max_tokens" in _error(e)["message"]
    convo = [*ASK, {"role": "assistant", "content": "Red."},
             {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                          {"type": "image", "source": {"type": "url", "url": "ftp://x/a.png"}}]}]
    with pytest.raises(anthropic.BadRequestError) as e:  # the Anthropic block is named, not the chat part
        c.messages.create(model="smollm2", system=SYSTEM, messages=convo, max_tokens=2)
    assert _error(e)["message"].startswith("messages.2.content.1.source: unsupported image URL scheme")
    # the bad requests left the server serving
    ok = c.messages.create(model="smollm2", messages=ASK, max_tokens=2, **GREEDY)
    assert ok.usage.output_tokens == 2
