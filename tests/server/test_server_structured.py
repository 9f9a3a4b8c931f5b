"""Structured output and tool calls through the ``openai`` client on the real server
subprocesses: the text server (embedded SmolLM2, whose tokenizer has no ``<tool_call>``
token, so the grammar spells it) and the VLM server (tiny random Qwen2.5-VL with the Qwen
tokenizer, images in the conversation). Sampling at temperature 1 with seeds: the outputs
are valid because the grammar makes them so."""

from __future__ import annotations

import base64
import json
import re

import jsonschema
import pytest

from helpers import IMAGES

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "sights": {"type": "array", "items": {"enum": ["tower", "museum", "park"]},
                                    "minItems": 1, "maxItems": 3},
                         "stay": {"type": "object", "properties": {"nights": {"type": "integer", "minimum": 1,
                                                                              "maximum": 30}},
                                  "required": ["nights"], "additionalProperties": False}},
          "required": ["city", "sights", "stay"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ZOOM = {"type": "object", "properties": {"factor": {"enum": [1, 2, 4]}}, "required": ["factor"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "zoom", "description": "Zoom into the image", "parameters": ZOOM}}]
PARAMS = {"get_weather": WEATHER, "zoom": ZOOM}
USER = [{"role": "user", "content": "Plan a trip to Paris as JSON."}]


def _valid_calls(calls):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def _collect_stream(stream):
    """Concatenate a streamed chat choice 0: content, tool calls by index, finish_reason."""
    content, calls, finish, roles = "", {}, None, []
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            if d.role:
                roles.append(d.role)
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert entry["id"] is None  # id and name once per call
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    assert entry["name"] is None
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            if ch.finish_reason:
                finish = ch.finish_reason
    assert roles == ["assistant"]
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.server
@pytest.mark.text
class TestTextServer:
    def test_response_format_json_schema_n3_with_logprobs(self, text_server):
        r = text_server.client().chat.completions.create(
            model="smollm2", messages=USER, max_tokens=150, temperature=1.0, seed=5, n=3, logprobs=True,
            top_logprobs=2, response_format={"type": "json_schema",
                                             "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}})
        assert len(r.choices) == 3
        for ch in r.choices:
            assert ch.finish_reason == "stop"
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
            assert ch.logprobs.content
            assert all(t.logprob <= 0 for t in ch.logprobs.content)

    def test_streamed_json_object_and_completions_extras(self, text_server):
        client = text_server.client()
        stream = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=120, temperature=0,
                                                stream=True, response_format={"type": "json_object"})
        content, calls, finish = _collect_stream(stream)
        assert not calls
        if finish == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert finish == "length" and content.startswith("{")
        r = client.completions.create(model="smollm2", prompt="The answer is", max_tokens=10, temperature=1.0, seed=1,
                                      n=3, extra_body={"guided_choice": ["yes", "no"]})
        assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in r.choices)
        r = client.completions.create(model="smollm2", prompt="Code:", max_tokens=20, temperature=1.0, seed=2,
                                      extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text)
        r = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=20, temperature=1.0, seed=3,
                                           extra_body={"structured_outputs": {"grammar": 'start: "x" ("y" | "z")+ "!"'},
                                                       })
        assert r.choices[0].finish_reason in ("stop", "length")
        text = r.choices[0].message.content
        assert re.fullmatch(r"x[yz]+!", text) if r.choices[0].finish_reason == "stop" else re.fullmatch(r"x[yz]*", text)
        r = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=150, temperature=1.0, seed=4,
                                           extra_body={"guided_json": SCHEMA})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)

    def test_tool_calls_required_named_streamed(self, text_server):
        client = text_server.client()
        r = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=200, temperature=1.0, seed=1,
                                           n=2, tools=TOOLS, tool_choice="required")
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls"
            _valid_calls(ch.message.tool_calls)
        r = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=100, temperature=1.0, seed=2,
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": "zoom"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "zoom" and r.choices[0].finish_reason == "tool_calls"
        _valid_calls([call])
        stream = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=200, temperature=1.0,
                                                seed=1, tools=TOOLS, tool_choice="required", stream=True)
        content, calls, finish = _collect_stream(stream)
        assert finish == "tool_calls" and content == ""
        for c in calls:
            assert c["id"] and c["name"] in PARAMS
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
        # the same seed non-streamed gives the same calls
        again = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=200, temperature=1.0,
                                               seed=1, tools=TOOLS, tool_choice="required")
        assert [(c.function.name, c.function.arguments) for c in again.choices[0].message.tool_calls] == \
            [(c["name"], c["arguments"]) for c in calls]

    def test_tool_results_accepted_in_the_next_turn(self, text_server):
        client = text_server.client()
        r = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=100, temperature=0,
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": "zoom"}})
        msg = r.choices[0].message
        turn = USER + [msg.model_dump(exclude_none=True)]
        turn += [{"role": "tool", "tool_call_id": c.id, "content": "zoomed"} for c in msg.tool_calls]
        nxt = client.chat.completions.create(model="smollm2", messages=turn, max_tokens=8, temperature=0, tools=TOOLS)
        assert nxt.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert nxt.usage.prompt_tokens > r.usage.prompt_tokens
        none = client.chat.completions.create(model="smollm2", messages=turn, max_tokens=8, temperature=0, tools=TOOLS,
                                              tool_choice="none")
        assert none.choices[0].message.tool_calls is None


def _photo_uri() -> str:
    return "data:image/jpeg;base64," + base64.b64encode((IMAGES / "grace_hopper.jpg").read_bytes()).decode()


@pytest.mark.server
@pytest.mark.vlm
class TestVLMServer:
    def _image_msgs(self, text="What is in this image? Answer in JSON."):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _photo_uri()}},
                                             {"type": "text", "text": text}]}]

    def test_image_with_json_schema_streamed_and_not(self, vlm_server):
        client = vlm_server.client()
        r = client.chat.completions.create(model="tiny-vl", messages=self._image_msgs(), max_tokens=150,
                                           temperature=1.0, seed=7, n=3,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "trip", "schema": SCHEMA}})
        for ch in r.choices:
            assert ch.finish_reason == "stop"
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
        stream = client.chat.completions.create(model="tiny-vl", messages=self._image_msgs(), max_tokens=150,
                                                temperature=1.0, seed=7, stream=True,
                                                response_format={"type": "json_schema",
                                                                 "json_schema": {"name": "trip", "schema": SCHEMA}})
        content, _, finish = _collect_stream(stream)
        assert finish == "stop" and content == r.choices[0].message.content

    def test_parallel_tool_calls_with_an_image(self, vlm_server):
        client = vlm_server.client()
        r = client.chat.completions.create(model="tiny-vl", messages=self._image_msgs("Zoom in and check the weather."),
                                           max_tokens=400, temperature=1.0, seed=3, n=6, tools=TOOLS,
                                           tool_choice="required")
        counts = []
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls"
            _valid_calls(ch.message.tool_calls)
            counts.append(len(ch.message.tool_calls))
        assert max(counts) > 1, counts  # parallel calls among the seeds
        stream = client.chat.completions.create(model="tiny-vl",
                                                messages=self._image_msgs("Zoom in and check the weather."),
                                                max_tokens=400, temperature=1.0, seed=3, tools=TOOLS,
                                                tool_choice="required", stream=True)
        content, calls, finish = _collect_stream(stream)
        assert finish == "tool_calls" and calls
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        # the calls and a tool answer go back in with the image still in the conversation
        msg = r.choices[0].message
        turn = self._image_msgs("Zoom in and check the weather.") + [msg.model_dump(exclude_none=True)]
        turn += [{"role": "tool", "tool_call_id": c.id, "content": '{"ok": true}'} for c in msg.tool_calls]
        nxt = client.chat.completions.create(model="tiny-vl", messages=turn, max_tokens=4, temperature=0, tools=TOOLS)
        assert nxt.choices[0].finish_reason in ("stop", "length", "tool_calls")
