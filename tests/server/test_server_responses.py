"""``/v1/responses`` (OpenAI's Responses API) through the ``openai`` SDK on the text server
(embedded SmolLM2, greedy): the same answer as chat completions for the same request,
whole and streamed (OpenAI's event order), ``max_output_tokens`` as ``incomplete``, a tool
call round trip, ``text.format`` JSON, the store (GET, DELETE, ``previous_response_id``)
and errors naming the Responses field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from test_server_structured import PARAMS, SCHEMA, WEATHER

pytestmark = [pytest.mark.server, pytest.mark.text]

ASK = "Name three colors."
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER}]


def _chat(client, messages, n, **extra):
    return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=n, temperature=0, **extra)


def test_string_input_and_instructions_equal_chat(text_server):
    client = text_server.client()
    resp = client.responses.create(model="smollm2", input=ASK, instructions="Answer briefly.", max_output_tokens=12,
                                   temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}], 12)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert [i.type for i in resp.output] == ["message"] and resp.output[0].content[0].type == "output_text"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None


def test_cut_by_max_output_tokens_is_incomplete(text_server):
    resp = text_server.client().responses.create(model="smollm2", input="Write a long story about a cat.",
                                                 max_output_tokens=3, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3


def test_item_history_with_parts_equals_chat(text_server):
    client = text_server.client()
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    resp = client.responses.create(model="smollm2", input=items, max_output_tokens=10, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": ASK}], 10)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_event_order_and_text_equal_whole(text_server):
    client = text_server.client()
    whole = client.responses.create(model="smollm2", input=ASK, max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model="smollm2", input=ASK, max_output_tokens=12, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == \
        whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id


def test_sdk_stream_helper_final_response(text_server):
    client = text_server.client()
    with client.responses.stream(model="smollm2", input=ASK, max_output_tokens=64, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()  # the SDK's helper needs response.completed: SmolLM2 ends in 64 tokens
    assert final.status == "completed" and final.output_text == text and text


def test_tool_call_round_trip(text_server):
    client = text_server.client()
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = client.responses.create(model="smollm2", input=question, tools=FLAT_TOOLS, tool_choice="required",
                                   max_output_tokens=80, temperature=0)
    calls = [i for i in resp.output if i.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), PARAMS["get_weather"])
    chat = _chat(client, question, 80, tools=[{"type": "function", "function": {k: v for k, v in FLAT_TOOLS[0].items()
                                                                              if k != "type"}}],
                 tool_choice="required")
    assert [(c.name, c.arguments) for c in calls] == [(c.function.name, c.function.arguments)
                                                      for c in chat.choices[0].message.tool_calls]
    follow = question + [c.model_dump(exclude_none=True) for c in calls] + [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 21}'} for c in calls]
    answer = client.responses.create(model="smollm2", input=follow, tools=FLAT_TOOLS, tool_choice="none",
                                     max_output_tokens=10, temperature=0)
    history = question + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.call_id, "content": '{"temp_c": 21}'} for c in calls]
    expected = _chat(client, history, 10, tools=[{"type": "function", "function": {
        k: v for k, v in FLAT_TOOLS[0].items() if k != "type"}}], tool_choice="none")
    assert answer.output_text == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens


def test_streamed_tool_call_equals_whole(text_server):
    client = text_server.client()
    ask = dict(model="smollm2", input="What is the weather in Oslo?", tools=FLAT_TOOLS, tool_choice="required",
               max_output_tokens=80, temperature=0)
    whole = [(i.name, i.arguments) for i in client.responses.create(**ask).output if i.type == "function_call"]
    events = list(client.responses.create(stream=True, **ask))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert whole and [(i.name, i.arguments) for i in done] == whole
    for item in done:  # per call: added, its argument fragments, arguments done, item done
        mine = [e for e in events if getattr(e, "item_id", None) == item.id or getattr(
            getattr(e, "item", None), "id", None) == item.id]
        kinds = [e.type for e in mine]
        fragments = kinds.count("response.function_call_arguments.delta")
        assert fragments >= 1 and kinds == ["response.output_item.added",
                                            *["response.function_call_arguments.delta"] * fragments,
                                            "response.function_call_arguments.done", "response.output_item.done"]
        assert "".join(e.delta for e in mine[1:-2]) == mine[-2].arguments == item.arguments
        assert mine[0].item.status == "in_progress" and item.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_text_format_json_schema(text_server):
    resp = text_server.client().responses.create(
        model="smollm2", input="Plan a trip to Paris as JSON.", max_output_tokens=120, temperature=0,
        text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)


def test_store_get_delete_and_previous_response_id(text_server):
    client = text_server.client()
    first = client.responses.create(model="smollm2", input="My name is Ada.", max_output_tokens=6, temperature=0)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = client.responses.create(model="smollm2", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    chat = _chat(client, [{"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], 6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="smollm2", input="again", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_not_stored_is_not_retrievable(text_server):
    client = text_server.client()
    resp = client.responses.create(model="smollm2", input=ASK, max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.image_url"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": ASK, "logit_bias": {"1": 500}}, "logit_bias.1"),
    ({"input": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [], "instructions": None}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(text_server, body, param):
    r = httpx.post(f"{text_server.url}/v1/responses", json={"model": "smollm2", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_unknown_model_is_a_404(text_server):
    with pytest.raises(openai.NotFoundError) as e:
        text_server.client().responses.create(model="nope", input=ASK)
    assert e.value.body["param"] == "model"


def test_tool_result_after_previous_response_id_equals_stateless(text_server):
    client = text_server.client()
    question = "What is the weather in Rome?"
    first = client.responses.create(model="smollm2", input=question, tools=FLAT_TOOLS, tool_choice="required",
                                    max_output_tokens=80, temperature=0)
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 18}'} for c in calls]
    chained = client.responses.create(model="smollm2", previous_response_id=first.id, input=results,
                                      max_output_tokens=10, temperature=0)
    stateless = client.responses.create(model="smollm2", max_output_tokens=10, temperature=0, input=[
        {"role": "user", "content": question}, *[c.model_dump(exclude_none=True) for c in calls], *results])
    assert chained.output_text == stateless.output_text
    assert chained.usage.input_tokens == stateless.usage.input_tokens


def test_openapi_declares_the_responses_routes(text_server):
    paths = httpx.get(f"{text_server.url}/openapi.json", timeout=30).json()["paths"]
    assert set(paths["/v1/responses"]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                  "text/event-stream"}
    assert "404" in paths["/v1/responses/{response_id}"]["get"]["responses"]
    assert "404" in paths["/v1/responses/{response_id}"]["delete"]["responses"]
