"""Tool calls through ``LLM.chat(tools=...)`` and Qwen3 reasoning on tiny random models (the
Qwen tokenizer here is Qwen3's, whose template renders tools and ``enable_thinking``).
Forced tokens come from an observer that raises chosen logits: the grammar still has the
last word, which is what these tests check."""

from __future__ import annotations

import json

import jsonschema
import pytest

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.entrypoints.openai.chat_output import ChatChoiceOutput
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.reasoning import ENDED, MAYBE, REASONING

pytestmark = pytest.mark.text

KW = dict(dtype="float32", max_model_len=1024, kv_cache_memory=32 << 20)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ZOOM = {"type": "object", "properties": {"factor": {"enum": [1, 2, 4]}}, "required": ["factor"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "zoom", "parameters": ZOOM}}]
SCHEMAS = {"get_weather": WEATHER, "zoom": ZOOM}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), **KW)


@pytest.fixture(scope="module")
def thinker(tiny_models):
    return LLM(str(tiny_models["qwen3"][0]), reasoning_parser="qwen3", **KW)


def test_tools_rendered_by_the_template(llm):
    p = llm.engine.process_prompt({"messages": ASK, "tools": TOOLS})
    text = llm.tokenizer.decode(p.prompt_token_ids)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert text == llm.tokenizer.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def _check_calls(out, names=None):
    assert out.finish_reason == "tool_calls", (out.text, out.finish_reason)
    assert out.tool_calls
    for call in out.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_required_and_named_tool_choice_always_parse(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=400) for s in range(6)]
    for out in llm.chat([ASK] * 6, params, tools=TOOLS, tool_choice="required", use_tqdm=False):
        _check_calls(out)
    named = {"type": "function", "function": {"name": "zoom"}}
    outs = llm.chat([ASK] * 4, params[:4], tools=TOOLS, tool_choice=named, use_tqdm=False)
    for out in outs:
        _check_calls(out, ["zoom"])
        assert len(out.tool_calls) == 1
    one = llm.chat([ASK] * 4, params[:4], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   use_tqdm=False)
    assert all(len(o.tool_calls) == 1 for o in one)
    with pytest.raises(ValueError, match="not in tools"):
        llm.chat(ASK, params[0], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_parallel_calls_and_tool_message_round_trip(llm):
    outs = llm.chat([ASK] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=400) for s in range(8)],
                    tools=TOOLS, tool_choice="required", use_tqdm=False)
    multi = [o for o in outs if len(o.tool_calls) > 1]
    assert multi, [len(o.tool_calls) for o in outs]  # some seeds call more than once
    out = multi[0]
    _check_calls(out)
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": out.tool_calls}]
    turn += [{"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 21}'} for c in out.tool_calls]
    p = llm.engine.process_prompt({"messages": turn, "tools": TOOLS})
    text = llm.tokenizer.decode(p.prompt_token_ids).split("Weather in Paris")[1]  # after the tools preamble
    assert text.count("<tool_response>") == len(out.tool_calls) and text.count("<tool_call>") == len(out.tool_calls)
    assert out.tool_calls[0]["function"]["arguments"] in text
    (nxt,) = llm.chat([turn], SamplingParams(temperature=0, max_tokens=8), tools=TOOLS, use_tqdm=False)
    assert nxt.finish_reason in ("length", "stop") and nxt.tool_calls == []


def _force(llm, token_ids: list[int]):
    """An observer pushing ``token_ids[k]`` to the top of a row sampling its k-th output token."""
    def observe(chunks, inp, logits, sampled):
        for row, index in enumerate(sampled):
            k = chunks[index][0].num_output_tokens
            if k < len(token_ids):
                logits[row, token_ids[k]] += 1e4
    llm.engine.runner.observers.append(observe)
    return observe


SIMPLE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_grammar_applies_after_the_reasoning(thinker):
    tok = thinker.tokenizer
    rp = thinker.engine.reasoning_parser
    thought = tok.encode(" let me think", add_special_tokens=False)
    forced = [rp.start_token_id, *thought, rp.end_token_id]
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=80, structured_outputs={"json": SIMPLE})
    obs = _force(thinker, forced)
    try:
        (out,) = thinker.chat(ASK, sp, use_tqdm=False)
        (off,) = thinker.chat(ASK, sp, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    finally:
        thinker.engine.runner.observers.remove(obs)
    # thinking on: the forced reasoning is free text (not JSON), the answer after it is valid
    assert out.token_ids[:len(forced)] == forced and out.finish_reason == "stop"
    reasoning, content = rp.extract_reasoning(out.text, MAYBE)
    assert reasoning == " let me think"
    jsonschema.validate(json.loads(content), SIMPLE)
    # LLM.chat splits it the same way (the server's chat_output split, on the library API)
    assert (out.reasoning_content, out.content) == (reasoning, content) and out.text.endswith(content)
    assert off.reasoning_content is None and off.content == off.text
    # thinking off: the prompt closed the reasoning, so the grammar refuses <think> at once
    p = thinker.engine.process_prompt({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})
    assert rp.initial_state(p.prompt_token_ids) == ENDED
    assert rp.start_token_id not in off.token_ids and off.finish_reason == "stop"
    jsonschema.validate(json.loads(off.text), SIMPLE)


def test_reasoning_split_streamed_equals_whole():
    from atlas_vlm.reasoning import ReasoningParser

    rp = ReasoningParser(1, 2, "<think>", "</think>")
    text = '<think>\nso: a <b> c </thin\n</think>\n\n<tool_call>\n{"name": "zoom", "arguments": {"factor": 2}}\n</tool_call>'
    view = ChatChoiceOutput(rp, parse_tools=True)
    deltas = []
    for i in range(1, len(text) + 1):
        out = RequestOutput("r", None, [5, 6], text=text[:i], finish_reason="stop" if i == len(text) else None)
        deltas.append(view.delta(out))
    reasoning = "".join(d.get("reasoning_content", "") for d, _ in deltas)
    content = "".join(d.get("content", "") for d, _ in deltas)
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    message, finish = ChatChoiceOutput(rp, parse_tools=True).message(out)
    assert reasoning == message["reasoning_content"] == "\nso: a <b> c </thin\n"
    assert content == "" and message["content"] is None
    assert deltas[-1][1] == finish == "tool_calls"
    assert calls[0]["function"]["name"] == "zoom" and calls[0]["index"] == 0 and "id" in calls[0]
    assert "".join(c["function"]["arguments"] for c in calls) == message["tool_calls"][0]["function"]["arguments"]
    assert rp.initial_state([5, 1]) == REASONING and rp.initial_state([1, 9, 2, 5]) == ENDED
