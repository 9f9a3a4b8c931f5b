"""Tool calls as real models write them (issue 35, item 8): Qwen2.5-Coder's fenced JSON,
Qwen2.5-Instruct's ``<tool_call>`` blocks, Qwen3 thinking before a call, Llama 3.1's bare and
``<|python_tag|>`` calls; whole, and streamed char by char and in token-sized chunks, with the
same result; JSON that does not name a requested tool stays content. The samples are the texts
those models give for the weather prompt (Q4_K_M GGUFs under llama.cpp's templates)."""

from __future__ import annotations

import json

import pytest

from atlas_vlm.entrypoints.openai.chat_output import ChatChoiceOutput, split_output
from atlas_vlm.reasoning import MAYBE, ReasoningParser
from atlas_vlm.tool_parsers import ToolCallStreamer, ToolParserManager

pytestmark = pytest.mark.text

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
PARIS = ("get_weather", {"location": "Paris, France", "unit": "celsius"})
TOKYO = ("get_weather", {"location": "Tokyo, Japan", "unit": "celsius"})

# (parser, model output, content, calls)
SAMPLES = {
    "qwen2.5-coder fenced": ("hermes", '```json\n{"name": "get_weather", "arguments": {"location": "Paris, France", '
                             '"unit": "celsius"}}\n```', None, [PARIS]),
    "qwen2.5-coder fenced, prose around": (
        "hermes", 'I\'ll check the weather for you.\n\n```json\n{\n  "name": "get_weather",\n  "arguments": {\n    '
        '"location": "Paris, France",\n    "unit": "celsius"\n  }\n}\n```\n\nLet me know if you need more.',
        "I'll check the weather for you.\n\n\n\nLet me know if you need more.", [PARIS]),
    "qwen2.5-coder plain fence, two calls as a list": (
        "hermes", '```\n[{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}, '
        '{"name": "get_weather", "parameters": {"location": "Tokyo, Japan", "unit": "celsius"}}]\n```', None,
        [PARIS, TOKYO]),
    "bare JSON, arguments as a string": (
        "hermes", '{"name": "get_weather", "arguments": "{\\"location\\": \\"Paris, France\\", \\"unit\\": '
        '\\"celsius\\"}"}', None, [PARIS]),
    "qwen2.5-instruct tool_call": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": '
                                   '"Paris, France", "unit": "celsius"}}\n</tool_call>', None, [PARIS]),
    "qwen2.5-instruct two tool_calls": (
        "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo, Japan", '
        '"unit": "celsius"}}\n</tool_call>', None, [PARIS, TOKYO]),
    "qwen3 thinking then a call (no reasoning parser)": (
        "hermes", '<think>\nThe user asks about Paris. I should call get_weather with {"location": "Paris"}.\n'
        '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": '
        '"celsius"}}\n</tool_call>', '<think>\nThe user asks about Paris. I should call get_weather with '
        '{"location": "Paris"}.\n</think>\n\n', [PARIS]),
    "llama3.1 bare": ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": '
                      '"celsius"}}', None, [PARIS]),
    "llama3.2 type function": ("llama3_json", '{"type": "function", "name": "get_weather", "parameters": '
                               '{"location": "Paris, France", "unit": "celsius"}}', None, [PARIS]),
    "llama3.1 python_tag, two calls": (
        "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": '
        '"celsius"}}; {"name": "get_weather", "parameters": {"location": "Tokyo, Japan", "unit": "celsius"}}',
        None, [PARIS, TOKYO]),
    "llama3.1 prose then a call": (
        "llama3_json", 'Let me check.\n{"name": "get_weather", "parameters": {"location": "Paris, France", '
        '"unit": "celsius"}}', "Let me check.\n", [PARIS]),
    # not calls: no requested tool named, no arguments key, or not JSON
    "JSON about something else": ("hermes", 'Here is the config:\n```json\n{"name": "atlas", "version": 2}\n```',
                                  'Here is the config:\n```json\n{"name": "atlas", "version": 2}\n```', []),
    "an unknown tool": ("hermes", '{"name": "get_stock", "arguments": {"ticker": "ACME"}}',
                        '{"name": "get_stock", "arguments": {"ticker": "ACME"}}', []),
    "a name without arguments in prose": ("hermes", 'Call {"name": "get_weather"} later, or use [1, 2] and {x}.',
                                          'Call {"name": "get_weather"} later, or use [1, 2] and {x}.', []),
    "python code fence": ("hermes", '```python\nd = {"a": [1, 2]}\nprint(d["a"])\n```',
                          '```python\nd = {"a": [1, 2]}\nprint(d["a"])\n```', []),
}


def _pairs(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(parser, chunks):
    """``(content, calls)`` of the output fed chunk by chunk."""
    streamer, text, content, calls = ToolCallStreamer(parser), "", "", []
    for n, chunk in enumerate(chunks):
        text += chunk
        delta, deltas = streamer.feed(text, n == len(chunks) - 1)
        content += delta
        assert [d["index"] for d in deltas] == list(range(len(calls), len(calls) + len(deltas)))
        calls += deltas
    return content, calls


def _token_chunks(text: str) -> list[str]:
    """``text`` cut as a BPE tokenizer would about: words with their leading space, punctuation apart."""
    import re
    return re.findall(r" ?\w+| ?[^\w\s]+|\s+", text)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_real_model_outputs_whole_and_streamed(name):
    fmt, text, content, calls = SAMPLES[name]
    cls = ToolParserManager.get_tool_parser(fmt)
    got_content, got = cls(TOOLS).extract(text)
    assert (got_content, _pairs(got)) == (content, calls)
    for chunks in (list(text), _token_chunks(text), [text[:len(text) // 2], text[len(text) // 2:]]):
        assert "".join(chunks) == text
        streamed_content, streamed = _stream(cls(TOOLS), chunks)
        assert streamed_content == (content or "") and _pairs(streamed) == calls
        # each call whole in one delta; the arguments strings equal the non-streamed ones
        assert [d["function"]["arguments"] for d in streamed] == [c["function"]["arguments"] for c in got]


def test_cut_calls_and_held_text():
    hermes = ToolParserManager.get_tool_parser("hermes")(TOOLS)
    # a fenced call cut by max_tokens is dropped; a cut object that names no tool is content
    assert hermes.extract('Sure.\n```json\n{"name": "get_weather", "arguments": {"loc') == ("Sure.\n", [])
    assert hermes.extract('A set {"a": 1, "b"') == ('A set {"a": 1, "b"', [])
    # while a call may be starting, its text is held back; prose before it is not
    streamer = ToolCallStreamer(hermes)
    assert streamer.feed("Sure. ``", False) == ("Sure. ", [])
    assert streamer.feed('Sure. ```json\n{"name": "get_weather", "argu', False) == ("", [])
    whole = 'Sure. ```json\n{"name": "get_weather", "arguments": {}}\n```'
    assert streamer.feed(whole[:-2], False) == ("", [])  # the closing fence may still come
    content, (call,) = streamer.feed(whole, False)
    assert content == "" and call["function"] == {"name": "get_weather", "arguments": "{}"}


def test_streaming_reads_only_the_new_text():
    """Per-chunk cost is flat: the scan never goes back over decided text (a probe string
    whose searches are counted from where they start)."""
    hermes = ToolParserManager.get_tool_parser("hermes")(TOOLS)
    streamer = ToolCallStreamer(hermes)
    text = ""
    for i in range(300):
        text += f"word {i} and [x] or {{y}} "
        streamer.feed(text, False)
        assert streamer.search >= len(text) - 8  # all but a short tail decided
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, deltas = streamer.feed(text + call, True)
    assert [d["function"]["name"] for d in deltas] == ["get_time"]


def test_qwen3_thinking_and_call_through_the_chat_output():
    """The reasoning parser takes the thinking; the call after it is read from the content,
    whole (``split_output``, as ``LLM.chat`` does) and streamed (``ChatChoiceOutput``)."""
    reasoning = ReasoningParser(start_token_id=1, end_token_id=2, start="<think>", end="</think>")
    text = SAMPLES["qwen3 thinking then a call (no reasoning parser)"][1]
    parser = ToolParserManager.get_tool_parser("hermes")
    thought, content, calls = split_output(text, reasoning, MAYBE, parser(TOOLS))
    assert thought.startswith("\nThe user asks") and content is None and _pairs(calls) == [PARIS]
    view = ChatChoiceOutput(reasoning, True, parser(TOOLS))
    out = type("Out", (), {"prompt_token_ids": [5], "finished": False, "finish_reason": None, "text": ""})()
    got_reasoning, got_calls = "", []
    for n, chunk in enumerate(_token_chunks(text)):
        out.text, out.finished = chunk, n == len(_token_chunks(text)) - 1
        out.finish_reason = "stop" if out.finished else None
        delta, finish = view.feed_delta(out)
        got_reasoning += delta.get("reasoning_content", "")
        got_calls += delta.get("tool_calls", [])
        assert "content" not in delta
    assert got_reasoning == thought and _pairs(got_calls) == [PARIS] and finish == "tool_calls"
