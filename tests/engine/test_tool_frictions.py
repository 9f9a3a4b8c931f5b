"""Tool-call frictions found through the ``openai`` client (issue 24), on the tiny random Qwen2
model of ``test_tools_reasoning.py``: the forced-tool grammar lets the model end after any
complete call; a call cut by ``max_tokens`` is dropped and the complete ones kept, streamed
and whole alike (the server's ``ChatChoiceOutput`` fed with ``LLM.chat``'s stream)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.entrypoints.openai.chat_output import ChatChoiceOutput
from atlas_vlm.entrypoints.openai.tool_parsers import END, START, extract_tool_calls

pytestmark = pytest.mark.text

KW = dict(dtype="float32", max_model_len=1024, kv_cache_memory=32 << 20)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ZOOM = {"type": "object", "properties": {"factor": {"enum": [1, 2, 4]}}, "required": ["factor"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "zoom", "parameters": ZOOM}}]
SCHEMAS = {"get_weather": WEATHER, "zoom": ZOOM}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), **KW)


def _streamed(llm, sp, **kw):
    """``(content, [(name, arguments)], finish_reason)`` of ``LLM.chat``'s stream through the
    server's delta builder, plus the last output."""
    view, content, calls, finish, last = ChatChoiceOutput(parse_tools=True), "", [], None, None
    for out in llm.chat(ASK, sp, tools=TOOLS, stream=True, use_tqdm=False, **kw):
        delta, reason = view.delta(out)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            assert d["index"] == len(calls) and d["id"].startswith("call_") and d["type"] == "function"
            calls.append((d["function"]["name"], d["function"]["arguments"]))
        finish, last = reason or finish, out
    return content, calls, finish, last


def test_cut_call_dropped_complete_calls_kept_streamed_and_whole(llm):
    (full,) = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=200), tools=TOOLS, tool_choice="required",
                       use_tqdm=False)
    assert full.text.count(END) >= 3  # the greedy random model repeats calls (parallel_tool_calls=True)
    # cut in the middle of the last complete call: the ones before it are complete
    last_start = full.text.rindex(START)
    n = next(k for k in range(len(full.token_ids))
             if len(llm.tokenizer.decode(full.token_ids[:k])) > last_start + len(START) + 12)
    sp = SamplingParams(temperature=0, max_tokens=n)
    (cut,) = llm.chat(ASK, sp, tools=TOOLS, tool_choice="required", use_tqdm=False)
    complete = cut.text.count(END)
    assert cut.finish_reason == "length" and cut.text.count(START) == complete + 1 and complete >= 2
    assert len(cut.tool_calls) == complete
    for call in cut.tool_calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    message, finish = ChatChoiceOutput(parse_tools=True).message(cut)
    assert finish == "length" and message["content"] is None
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert whole == [(c["function"]["name"], c["function"]["arguments"]) for c in cut.tool_calls]
    content, streamed, stream_finish, last = _streamed(llm, sp, tool_choice="required")
    assert last.text == cut.text and stream_finish == "length" and content == ""
    assert streamed == whole


def test_the_model_may_end_after_any_complete_call(llm):
    eos = sorted(llm.engine.eos_token_ids)

    def prefer_eos(chunks, inp, logits, sampled):  # EOS wins wherever the grammar allows it
        logits[:, eos] += 1e4

    llm.engine.runner.observers.append(prefer_eos)
    try:
        outs = llm.chat([ASK] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=200) for s in range(2)],
                        tools=TOOLS, tool_choice="required", use_tqdm=False)
        (one,) = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=200), tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False, use_tqdm=False)
    finally:
        llm.engine.runner.observers.remove(prefer_eos)
    for out in outs + [one]:  # ended at the first point it could: right after one whole call
        assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1, out.text
        assert out.text.endswith(END) and out.token_ids[-1] in eos


def test_trailing_newline_then_end_and_parser_edge_cases(llm):
    from atlas_vlm.entrypoints.openai.tool_parsers import tool_call_structured_outputs

    backend = llm.engine.structured_output_manager.backend
    call = '<tool_call>\n{"name": "zoom", "arguments": {"factor": 2}}\n</tool_call>'
    for parallel in (True, False):
        grammar = backend.compile_grammar(tool_call_structured_outputs(TOOLS, "required", parallel, True))
        assert all(grammar.accept_token(t) for t in llm.tokenizer.encode(call + "\n", add_special_tokens=False))
        assert grammar.accept_token(sorted(llm.engine.eos_token_ids)[0])  # EOS after the newline
    one = backend.compile_grammar(tool_call_structured_outputs(TOOLS, "required", False, True))
    assert not all(one.accept_token(t) for t in llm.tokenizer.encode(call + "\n" + call, add_special_tokens=False))
    # a cut last block is dropped; an unparsable closed block keeps the hermes rule (all content)
    assert extract_tool_calls("hi " + call + "\n<tool_call>\n{\"na")[0] == "hi "
    assert len(extract_tool_calls(call + "\n<tool_call>\n{\"na")[1]) == 1
    assert extract_tool_calls(START + "oops" + END + call) == (START + "oops" + END + call, [])
    assert extract_tool_calls("<tool_call>\n{\"na") == (None, [])
