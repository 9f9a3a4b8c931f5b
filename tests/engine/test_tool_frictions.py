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
from atlas_vlm.structured_output.tool_calls import tool_call_structured_outputs
from atlas_vlm.tool_parsers.hermes import END, START, HermesToolParser

from test_tools_reasoning import ASK, KW, SCHEMAS, WEATHER, ZOOM  # the same tools and question

pytestmark = pytest.mark.text

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "zoom", "parameters": ZOOM}}]


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
    backend = llm.engine.structured_output_manager.backend
    call = '<tool_call>\n{"name": "zoom", "arguments": {"factor": 2}}\n</tool_call>'
    for parallel in (True, False):
        grammar = backend.compile_grammar(tool_call_structured_outputs(TOOLS, "required", parallel, True))
        assert all(grammar.accept_token(t) for t in llm.tokenizer.encode(call + "\n", add_special_tokens=False))
        assert grammar.accept_token(sorted(llm.engine.eos_token_ids)[0])  # EOS after the newline
    one = backend.compile_grammar(tool_call_structured_outputs(TOOLS, "required", False, True))
    assert not all(one.accept_token(t) for t in llm.tokenizer.encode(call + "\n" + call, add_special_tokens=False))
    # a cut last block is dropped; an unparsable closed block is content, the calls around it kept
    assert HermesToolParser().extract("hi " + call + "\n<tool_call>\n{\"na")[0] == "hi "
    assert len(HermesToolParser().extract(call + "\n<tool_call>\n{\"na")[1]) == 1
    content, calls = HermesToolParser().extract(START + "oops" + END + call)
    assert content == START + "oops" + END and [c["function"]["name"] for c in calls] == ["zoom"]
    assert HermesToolParser().extract("<tool_call>\n{\"na") == (None, [])


# ChatML without any tools support (as SmolLM2's template)
NO_TOOLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_fallback_system_prompt_for_a_template_without_tools(llm, caplog, monkeypatch):
    from atlas_vlm.inputs import tool_prompt

    monkeypatch.setattr(tool_prompt, "_warned", False)
    tok = llm.tokenizer
    with caplog.at_level("WARNING", logger="atlas_vlm.inputs.tool_prompt"):
        p = llm.engine.process_prompt({"messages": ASK, "tools": TOOLS, "chat_template": NO_TOOLS_TEMPLATE})
    assert "does not render tools" in caplog.text
    text = tok.decode(p.prompt_token_ids)
    lines = [json.dumps(t) for t in TOOLS]
    assert text.startswith("<|im_start|>system\n# Tools\n") and "\n".join(lines) in text
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in text
    assert text.endswith("<|im_start|>user\nWeather in Paris for 3 days?<|im_end|>\n<|im_start|>assistant\n")
    # a system message of the caller's keeps its text, the block after a blank line
    sys_ask = [{"role": "system", "content": "Be brief."}] + ASK
    p = llm.engine.process_prompt({"messages": sys_ask, "tools": TOOLS, "chat_template": NO_TOOLS_TEMPLATE})
    assert tok.decode(p.prompt_token_ids).startswith(
        "<|im_start|>system\nBe brief.\n\n" + tool_prompt.tools_system_text(TOOLS) + "<|im_end|>")
    # a template that renders tools (Qwen's) is left alone
    p = llm.engine.process_prompt({"messages": ASK, "tools": TOOLS})
    assert tok.decode(p.prompt_token_ids) == tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False,
                                                                     add_generation_prompt=True)
    # tool_choice="auto": what the model writes in the format comes back as tool_calls
    call = '<tool_call>\n{"name": "zoom", "arguments": {"factor": 4}}\n</tool_call>'
    forced = tok.encode(call, add_special_tokens=False) + [sorted(llm.engine.eos_token_ids)[0]]

    def write_call(chunks, inp, logits, sampled):
        for row, index in enumerate(sampled):
            k = chunks[index][0].num_output_tokens
            if k < len(forced):
                logits[row, forced[k]] += 1e4

    llm.engine.runner.observers.append(write_call)
    try:
        (out,) = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=40), tools=TOOLS, tool_choice="auto",
                          chat_template=NO_TOOLS_TEMPLATE, use_tqdm=False)
    finally:
        llm.engine.runner.observers.remove(write_call)
    assert out.finish_reason == "tool_calls" and "<tools>" in tok.decode(out.prompt_token_ids)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == \
        [("zoom", {"factor": 4})]
