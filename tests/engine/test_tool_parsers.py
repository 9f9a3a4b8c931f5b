"""Tool-call formats behind the registry (issue 24): each parser reads whole outputs into the
right calls, keeps the content before them, drops a cut last call, and gives the same calls
when fed in small deltas; the registry, template detection, and ``tool_call_parser`` honoured
by ``LLM.chat`` and the server's request handling."""

from __future__ import annotations

import json
import types

import jsonschema
import pytest

from atlas_vlm.tool_parsers import ToolCallStreamer, ToolParser, ToolParserManager, detect_tool_parser

pytestmark = pytest.mark.text

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "code": {"type": "string"}, "opts": {"type": "object"}}}
ZOOM = {"type": "object", "properties": {"factor": {"type": "number"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "zoom", "parameters": ZOOM}}]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("zoom", {"factor": 2.5})]


def _hermes(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _coder(name, args):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# per format: (content prefix, text of the calls, separator between calls)
FORMATS = {
    "hermes": lambda calls: "\n".join(_hermes(n, a) for n, a in calls),
    "qwen3_coder": lambda calls: "\n".join(_coder(n, a) for n, a in calls),
    "llama3_json": lambda calls: "<|python_tag|>" + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls),
    "mistral": lambda calls: "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls]),
}


def _pairs(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(parser: ToolParser, text: str, step: int):
    """``(content, calls)`` of ``text`` fed to a streamer ``step`` characters at a time."""
    streamer, content, calls = ToolCallStreamer(parser), "", []
    for end in [*range(step, len(text), step), len(text)]:
        delta, deltas = streamer.feed(text[:end], end == len(text))
        content += delta
        for d in deltas:
            assert d["index"] == len(calls) and d["id"].startswith("call_") and d["type"] == "function"
            calls.append(d)
    return content, calls


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_whole_text_calls_content_and_cut_last_call(fmt):
    parser = ToolParserManager.get_tool_parser(fmt)(TOOLS)
    assert parser.name == fmt
    text = "Let me look that up. " + FORMATS[fmt](CALLS)
    content, calls = parser.extract(text)
    assert content == "Let me look that up. " and _pairs(calls) == CALLS
    assert len({c["id"] for c in calls}) == 2
    # cut in the middle of the second call: the first is kept, the cut one dropped
    cut = text[:text.index("zoom") + 6]
    content, calls = parser.extract(cut)
    assert content == "Let me look that up. " and _pairs(calls) == CALLS[:1]
    # no calls at all: everything is content
    assert parser.extract("Paris is sunny.") == ("Paris is sunny.", [])
    # a reply that is only calls has no content
    assert parser.extract(FORMATS[fmt](CALLS[1:]))[0] is None


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_stream_in_small_deltas_gives_the_whole_calls(fmt, step):
    cls = ToolParserManager.get_tool_parser(fmt)
    full = "Checking. " + FORMATS[fmt](CALLS)
    for text in (full, full[:full.index("zoom") + 6], "Just text, no calls {here}."):
        whole_content, whole = cls(TOOLS).extract(text)
        content, streamed = _stream(cls(TOOLS), text, step)
        assert content == (whole_content or "")
        assert [(d["function"]["name"], d["function"]["arguments"]) for d in streamed] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert len(_stream(cls(TOOLS), full, step)[1]) == 2


def test_qwen3_coder_values_typed_by_the_schema():
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(TOOLS)
    text = _coder("get_weather", {"city": "New\nYork", "days": "7", "code": "007", "opts": '{"unit": "C"}',
                                  "extra": "[1, 2]"})
    (call,) = parser.extract(text)[1]
    assert json.loads(call["function"]["arguments"]) == {"city": "New\nYork", "days": 7, "code": "007",
                                                        "opts": {"unit": "C"}, "extra": "[1, 2]"}
    # without the tools' schemas every value stays a string
    (call,) = ToolParserManager.get_tool_parser("qwen3_coder")().extract(text)[1]
    assert json.loads(call["function"]["arguments"])["days"] == "7"


def test_malformed_and_markerless_replies():
    hermes, llama, mistral = (ToolParserManager.get_tool_parser(n)(TOOLS) for n in ("hermes", "llama3_json", "mistral"))
    bad = "<tool_call>oops</tool_call>" + _hermes(*CALLS[0])
    # a closed block that is not a call is content; the calls around it stay calls (one scan, streamed alike)
    assert (hermes.extract(bad)[0], _pairs(hermes.extract(bad)[1])) == ("<tool_call>oops</tool_call>", CALLS[:1])
    # the markers are special tokens the detokenizer may drop: a reply opening with the JSON is read too
    assert _pairs(llama.extract(' {"name": "zoom", "parameters": {"factor": 2.5}}')[1]) == CALLS[1:]
    assert _pairs(mistral.extract('[{"name": "zoom", "arguments": {"factor": 2.5}}]')[1]) == CALLS[1:]
    # JSON that is not a call, or JSON inside prose, is content
    assert llama.extract('{"answer": 42}') == ('{"answer": 42}', [])
    assert llama.extract('The call is {"name": "zoom"}') == ('The call is {"name": "zoom"}', [])
    assert _stream(llama, '{"answer": 42}', 2) == ('{"answer": 42}', [])


def test_registry_lookup_and_unknown_name_refused():
    assert ToolParserManager.names() == ["hermes", "llama3_json", "mistral", "qwen3_coder"]
    with pytest.raises(ValueError, match=r"unknown tool_call_parser 'pythonic'; known parsers: hermes, "
                                         r"llama3_json, mistral, qwen3_coder"):
        ToolParserManager.get_tool_parser("pythonic")

    @ToolParserManager.register_module(["shout", "shout2"])
    class Shout(ToolParser):
        block_markers = {"CALL:": "\n"}

        def parse_block(self, body):
            return body.strip(), "{}"
    try:
        assert ToolParserManager.get_tool_parser("shout2") is Shout and Shout.name == "shout"
        assert _pairs(Shout().extract("hi CALL: ping")[1]) == [("ping", {})]
        with pytest.raises(ValueError, match="'hermes' is already registered"):
            ToolParserManager.register_module("hermes")(Shout)
    finally:
        for n in ("shout", "shout2"):
            ToolParserManager.tool_parsers.pop(n)


@pytest.mark.parametrize("template, name", [
    ("{% if tools %}<tool_call>\n{{ call | tojson }}\n</tool_call>{% endif %}", "hermes"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", "qwen3_coder"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{{- '<|python_tag|>' + call }}", "llama3_json"),
    ("<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}", "llama3_json"),
    ("{{ m.content }}", "hermes"), (None, "hermes"),
    ({"default": "{{ m.content }}", "tool_use": "[TOOL_CALLS]"}, "mistral"),
])
def test_detect_from_the_chat_template(template, name):
    assert detect_tool_parser(template) == name


def test_engine_config_and_cli_flag():
    from atlas_vlm.config import EngineConfig
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    with pytest.raises(ValueError, match="known parsers: hermes, llama3_json, mistral, qwen3_coder"):
        EngineConfig(model="m", tool_call_parser="nope")
    args = cli.build_parser().parse_args(["serve", "some/model", "--tool-call-parser", "qwen3_coder"])
    assert engine_config_from_args(args).tool_call_parser == "qwen3_coder"
    assert engine_config_from_args(cli.build_parser().parse_args(["serve", "m"])).tool_call_parser is None
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "m", "--tool-call-parser", "nope"])


def test_server_refuses_forced_calls_without_a_forcing_parser():
    from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest
    from atlas_vlm.entrypoints.openai.serving_chat import chat_constraint as _constraint
    from atlas_vlm.entrypoints.openai.serving_chat import chat_tool_parser as _tool_parser

    ctx = types.SimpleNamespace(tool_parser=ToolParserManager.get_tool_parser("qwen3_coder"),
                                engine=types.SimpleNamespace(tokenizer=None))  # never read: refused first
    ask = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "zoom"}}):
        with pytest.raises(APIError) as e:
            _constraint(ctx, ChatCompletionRequest(**ask, tool_choice=choice))
        assert e.value.status == 400 and e.value.param == "tool_choice"
        assert "hermes, llama3_json, mistral tool parsers only" in e.value.message
        assert "'qwen3_coder'" in e.value.message
    assert _constraint(ctx, ChatCompletionRequest(**ask, tool_choice="auto")) is None
    parser = _tool_parser(ctx, ChatCompletionRequest(**ask))
    assert parser.name == "qwen3_coder" and parser.tools == TOOLS
    assert _tool_parser(ctx, ChatCompletionRequest(**ask, tool_choice="none")) is None
    # no --tool-call-parser (the Ray ingress without one): the tokenizer's chat template decides
    for template, name in (("{#- [TOOL_CALLS] -#}", "mistral"), (None, "hermes")):
        ctx = types.SimpleNamespace(tool_parser=None, engine=types.SimpleNamespace(
            tokenizer=types.SimpleNamespace(chat_template=template)))
        assert _tool_parser(ctx, ChatCompletionRequest(**ask)).name == name


# LLM.chat on the tiny random Qwen2 model: its reply is forced (structured output ``choice``)
# to a Mistral-format call, so which parser reads it decides whether there is a call
KW = dict(dtype="float32", max_model_len=1024, kv_cache_memory=32 << 20)
ASK = [{"role": "user", "content": "Zoom in a bit."}]
MISTRAL_REPLY = FORMATS["mistral"](CALLS[1:])
STRICT = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False},
          "zoom": {"type": "object", "properties": {"factor": {"enum": [1, 2, 4]}}, "required": ["factor"],
                   "additionalProperties": False}}
STRICT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in STRICT.items()]
CHATML_MISTRAL = ("{#- [TOOL_CALLS] -#}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _forced_reply():
    from atlas_vlm import SamplingParams
    from atlas_vlm.structured_output import StructuredOutputsParams

    only = StructuredOutputsParams(choice=[MISTRAL_REPLY])
    return SamplingParams(temperature=0, max_tokens=60, structured_outputs=only)


def test_llm_chat_honours_tool_call_parser(tiny_models):
    from atlas_vlm import LLM, SamplingParams
    from atlas_vlm.entrypoints.openai.chat_output import ChatChoiceOutput

    llm = LLM(str(tiny_models["qwen2"][0]), tool_call_parser="mistral", **KW)
    (out,) = llm.chat(ASK, _forced_reply(), tools=TOOLS, use_tqdm=False)
    assert out.text == MISTRAL_REPLY and out.finish_reason == "tool_calls" and _pairs(out.tool_calls) == CALLS[1:]
    view, streamed = ChatChoiceOutput(parse_tools=True, tool_parser=ToolParserManager.get_tool_parser("mistral")()), []
    for o in llm.chat(ASK, _forced_reply(), tools=TOOLS, stream=True, use_tqdm=False):
        streamed += view.delta(o)[0].get("tool_calls", [])
    assert _pairs(streamed) == CALLS[1:]
    # forced calls in the bare-JSON list, read back by the mistral parser, arguments per schema
    outs = llm.chat([ASK] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=200) for s in range(2)],
                    tools=STRICT_TOOLS, tool_choice="required", use_tqdm=False)
    (named,) = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=200), tools=STRICT_TOOLS,
                        tool_choice={"type": "function", "function": {"name": "zoom"}}, use_tqdm=False)
    for out in outs + [named]:
        assert out.text.startswith("[{") and out.tool_calls, out.text
        for name, args in _pairs(out.tool_calls):
            jsonschema.validate(args, STRICT[name])
    assert [n for n, _ in _pairs(named.tool_calls)] == ["zoom"]


def test_llm_chat_detects_the_parser_from_the_template(tiny_models):
    from atlas_vlm import LLM

    llm = LLM(str(tiny_models["qwen2"][0]), **KW)
    (out,) = llm.chat(ASK, _forced_reply(), tools=TOOLS, chat_template=CHATML_MISTRAL, use_tqdm=False)
    assert out.text == MISTRAL_REPLY and _pairs(out.tool_calls) == CALLS[1:]
    # Qwen's template: hermes, for which the tag is text and the bare list is a call only of a
    # requested tool (mistral's parser reads any name after its tag)
    (out,) = llm.chat(ASK, _forced_reply(), tools=TOOLS[:1], use_tqdm=False)
    assert out.text == MISTRAL_REPLY and out.tool_calls == [] and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="tool parsers only; this model uses 'qwen3_coder'"):
        llm.chat(ASK, tools=TOOLS, tool_choice="required", chat_template="<function={{ x }}>", use_tqdm=False)


def test_forced_bare_json_grammars(tiny_models):
    from atlas_vlm import LLM
    from atlas_vlm.structured_output.tool_calls import json_tool_call_structured_outputs

    llm = LLM(str(tiny_models["qwen2"][0]), **KW)
    backend, tok = llm.engine.structured_output_manager.backend, llm.tokenizer
    eos = sorted(llm.engine.eos_token_ids)[0]

    def accepts(spec, text):
        grammar = backend.compile_grammar(spec)
        return all(grammar.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            grammar.accept_token(eos)
    llama = '{"name": "zoom", "parameters": {"factor": 2}}'
    mistral = '{"name": "zoom", "arguments": {"factor": 2}}'
    for parallel in (True, False):
        assert accepts(json_tool_call_structured_outputs(TOOLS, "required", parallel, "llama3_json"), llama)
        assert accepts(json_tool_call_structured_outputs(TOOLS, "required", parallel, "mistral"), f"[{mistral}]")
    assert accepts(json_tool_call_structured_outputs(TOOLS, "required", True, "llama3_json"), f"{llama}; {llama}")
    assert not accepts(json_tool_call_structured_outputs(TOOLS, "required", False, "llama3_json"), f"{llama}; {llama}")
    assert accepts(json_tool_call_structured_outputs(TOOLS, "required", True, "mistral"), f"[{mistral}, {mistral}]")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert not accepts(json_tool_call_structured_outputs(TOOLS, named, True, "mistral"), f"[{mistral}]")
    assert json_tool_call_structured_outputs(TOOLS, "auto", True, "mistral") is None
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        json_tool_call_structured_outputs(TOOLS, {"type": "function", "function": {"name": "nope"}}, True, "mistral")
