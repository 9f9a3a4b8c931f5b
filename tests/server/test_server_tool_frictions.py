"""Issue 24's tool-call and structured-output frictions through the ``openai`` client on the
text server (embedded SmolLM2, greedy): a forced call cut by ``max_tokens`` is dropped and
the complete ones kept, streamed and whole alike; tools reach a template that cannot render
them (SmolLM2's) through the fallback system prompt; an unenforced ``format`` is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from test_server_structured import PARAMS, TOOLS, USER, _collect_stream

pytestmark = [pytest.mark.server, pytest.mark.text]


def _raw(choice) -> str:
    """The choice's generated text, rebuilt from its logprobs' token strings."""
    return "".join(t.token for t in choice.logprobs.content)


def test_required_cut_by_length_same_calls_streamed_and_whole(text_server):
    client = text_server.client()
    ask = dict(model="smollm2", messages=USER, temperature=0, tools=TOOLS, tool_choice="required")
    long = client.chat.completions.create(max_tokens=160, logprobs=True, **ask).choices[0]
    tokens = [t.token for t in long.logprobs.content]
    raw = "".join(tokens)
    # with the tools in its prompt (the fallback) SmolLM2 ends its turn after its call
    assert long.finish_reason == "tool_calls" and raw.endswith("</tool_call><|im_end|>"), raw
    assert len(long.message.tool_calls) == raw.count("</tool_call>")
    cut_at = raw.rindex("<tool_call>") + len("<tool_call>") + 12  # inside the last call
    n = next(k for k in range(len(tokens)) if len("".join(tokens[:k])) > cut_at)
    whole = client.chat.completions.create(max_tokens=n, logprobs=True, **ask).choices[0]
    text = _raw(whole)
    complete = text.count("</tool_call>")  # the calls before the last one (none if it was the only one)
    assert text.count("<tool_call>") == complete + 1 and text == raw[:len(text)], text
    assert whole.finish_reason == "length" and whole.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert len(calls) == complete
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMS[name])
    content, streamed, finish = _collect_stream(client.chat.completions.create(max_tokens=n, stream=True, **ask))
    assert finish == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == calls


def test_auto_tools_reach_a_template_without_tools(text_server, text_llm):
    from atlas_vlm.inputs.tool_prompt import tools_system_text

    client = text_server.client()
    plain = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=1, temperature=0)
    auto = client.chat.completions.create(model="smollm2", messages=USER, max_tokens=1, temperature=0, tools=TOOLS,
                                          tool_choice="auto")
    expected = text_llm.engine.process_prompt({"messages": USER, "tools": TOOLS}).prompt_token_ids
    assert auto.usage.prompt_tokens == len(expected) > plain.usage.prompt_tokens
    assert tools_system_text(TOOLS) in text_llm.tokenizer.decode(expected)


def test_unenforced_format_is_a_400_naming_it(text_server):
    schema = {"type": "object", "properties": {"mail": {"type": "string", "format": "idn-email"}}}
    with pytest.raises(openai.BadRequestError) as e:
        text_server.client().chat.completions.create(
            model="smollm2", messages=USER, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert e.value.status_code == 400
    assert "format 'idn-email' at properties.mail is not supported" in e.value.message
    assert e.value.body["param"] == "response_format.json_schema.schema"
