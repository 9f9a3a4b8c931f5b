"""One parse per token (issue 33 item 5): the reasoning / tool-call split of a streamed chat
answer reads each step's new text only. Work is counted, not timed: the characters the scans
pass over (``ChatOutputSplitter.scanned``) and the Python lines run per step (``sys.settrace``),
over a 4,096-step answer with reasoning, prose, JSON and tool calls in every tool format; the
streamed deltas joined equal the one-shot split. Also: reasoning parsers come from a registry."""

from __future__ import annotations

import json
import random
import sys

import pytest

from atlas_vlm.entrypoints.chat_split import ChatOutputSplitter, split_output
from atlas_vlm.entrypoints.openai.chat_output import ChatChoiceOutput
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.reasoning import MAYBE, ReasoningParser, ReasoningParserManager, get_reasoning_parser
from atlas_vlm.tool_parsers import ToolParserManager

pytestmark = pytest.mark.text

RP = ReasoningParser(1, 2, "<think>", "</think>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}]
CALL = {"hermes": lambda n, a: f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>",
        "qwen3_coder": lambda n, a: f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items()) + "</function>\n</tool_call>",
        "llama3_json": lambda n, a: "<|python_tag|>" + json.dumps({"name": n, "parameters": a}),
        "mistral": lambda n, a: "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a}])}
STEPS = 4096


def _answer(fmt: str, rng: random.Random, thought_words: int = 2200, num_calls: int = 6) -> list[str]:
    """About 4,096 steps (pieces of 1-6 characters, as detokenized tokens): a long reasoning
    with brackets and near-markers, then prose with braces, fences and calls."""
    words = ["the", "city", "{", "}", "[", "]", "<", "</thin", "`", "\n", "weather", '"x"', "{\"a\": 1}", "ok"]
    thought = " ".join(rng.choice(words) for _ in range(thought_words))
    calls = []
    for i in range(num_calls):
        prose = " ".join(rng.choice(words[:2] + words[10:]) for _ in range(150))
        calls.append(prose + "\n" + CALL[fmt]("zoom" if i % 2 else "get_weather", {"city": f"c{i}", "days": i}))
    text = "<think>\n" + thought + "\n</think>\n\n" + "\n".join(calls)
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        pieces.append(text[i:i + k])
        i += k
    return pieces


@pytest.mark.parametrize("fmt", sorted(CALL))
def test_streamed_split_reads_each_step_once(fmt):
    pieces = _answer(fmt, random.Random(0))
    text = "".join(pieces)
    assert len(pieces) >= STEPS * 0.9  # a 4,096-token answer
    parser = ToolParserManager.get_tool_parser(fmt)(TOOLS)
    splitter = ChatOutputSplitter(RP, parser)
    lines = [0]

    def trace(frame, event, arg):
        if event == "line":
            lines[0] += 1
        return trace

    reasoning, content, calls, per_step_chars, per_step_lines = [], [], [], [], []
    for i, piece in enumerate(pieces):
        before_chars, before_lines = splitter.scanned, lines[0]
        sys.settrace(trace)
        try:
            r, c, d = splitter.feed(piece, i == len(pieces) - 1, [5, 6])
        finally:
            sys.settrace(None)
        per_step_chars.append(splitter.scanned - before_chars)
        per_step_lines.append(lines[0] - before_lines)
        reasoning.append(r), content.append(c), calls.extend(d)
    # the streamed deltas joined equal the one-shot split (the same pass fed once)
    whole_reasoning, whole_content, whole_calls = split_output(text, RP, MAYBE, ToolParserManager.get_tool_parser(fmt)(TOOLS))
    assert "".join(reasoning) == whole_reasoning and whole_reasoning.startswith("\n") and len(whole_reasoning) > 8000
    assert "".join(content) == (whole_content or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "zoom"] * 3
    # work: every character is examined (the counter is real), each about once by each scan
    # (reasoning scan: the whole text; tool scan: the content), never the whole text again
    assert len(text) <= splitter.scanned <= 2 * len(text)
    # flat per step: no step reads more than its piece plus a marker's or a call's length ...
    longest_call = max(len(CALL[fmt]("get_weather", {"city": "c0", "days": 0})), 64)
    assert max(per_step_chars) <= 2 * longest_call
    # ... and the Python lines run per step stay bounded along the answer (a step that walked
    # the text so far in Python would run thousands by its end): the last calls' steps cost
    # what the first ones' do
    assert max(per_step_lines) <= 400 and sum(per_step_lines) <= 100 * len(pieces), max(per_step_lines)
    content_steps = [i for i, c in enumerate(content) if c]
    half = content_steps[len(content_steps) // 2]
    early, late = per_step_lines[content_steps[0]:half], per_step_lines[half:]
    assert sum(late) / len(late) <= 1.5 * sum(early) / len(early), (sum(early) / len(early), sum(late) / len(late))


def test_chat_choice_output_streams_as_split():
    """The OpenAI view fed DELTA outputs (the server's path) and CUMULATIVE outputs (LLM.chat's
    stream) gives the same message as the whole output."""
    pieces = _answer("hermes", random.Random(1), thought_words=200, num_calls=2)
    text = "".join(pieces)
    as_delta, as_cumulative = ChatChoiceOutput(RP, True, ToolParserManager.get_tool_parser("hermes")(TOOLS)), \
        ChatChoiceOutput(RP, True, ToolParserManager.get_tool_parser("hermes")(TOOLS))
    joined = {"delta": {}, "cumulative": {}}
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        for kind, view, out_text in (("delta", as_delta, piece), ("cumulative", as_cumulative, "".join(pieces[:i + 1]))):
            out = RequestOutput("r", None, [5, 6] if i == 0 or kind == "cumulative" else [], text=out_text,
                                finish_reason="stop" if last else None)
            delta, finish = (view.feed_delta if kind == "delta" else view.delta)(out)
            for key, value in delta.items():
                joined[kind].setdefault(key, "" if key != "tool_calls" else [])
                joined[kind][key] += value
            assert finish == ("tool_calls" if last else None)
    whole = RequestOutput("r", None, [5, 6], text=text, finish_reason="stop")
    message, finish = ChatChoiceOutput(RP, True, ToolParserManager.get_tool_parser("hermes")(TOOLS)).message(whole)
    assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "zoom"]
    assert message["reasoning_content"].startswith("\n") and message["content"].strip()
    for kind in joined:
        assert joined[kind]["reasoning_content"] == message["reasoning_content"]
        assert joined[kind].get("content", "") == (message["content"] or "")
        assert [c["function"] for c in joined[kind]["tool_calls"]] == [c["function"] for c in message["tool_calls"]]


class _Tok:
    """A tokenizer stand-in with ``<think>`` / ``</think>`` as single tokens (ids 7, 8)."""

    unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return {"<think>": 7, "</think>": 8}.get(token, 0)

    def encode(self, text, add_special_tokens=False):
        return [self.convert_tokens_to_ids(text)]


def test_reasoning_parsers_come_from_a_registry():
    assert {"qwen3", "deepseek_r1"} <= set(ReasoningParserManager.names())
    rp = get_reasoning_parser("qwen3", _Tok())
    assert (rp.start_token_id, rp.end_token_id, rp.start, rp.end) == (7, 8, "<think>", "</think>")
    assert get_reasoning_parser(None, _Tok()) is None
    with pytest.raises(ValueError, match="unknown reasoning_parser 'qwen4'; known parsers: deepseek_r1, qwen3"):
        get_reasoning_parser("qwen4", _Tok())

    @ReasoningParserManager.register_module("test_only_markers")
    class Markers(ReasoningParser):
        def __init__(self, tokenizer):
            super().__init__(3, 4, "<r>", "</r>")
    try:
        assert "test_only_markers" in ReasoningParserManager.names()
        assert get_reasoning_parser("test_only_markers", _Tok()).extract_reasoning("<r>a</r>\nb") == ("a", "b")
        with pytest.raises(ValueError, match="already registered"):
            ReasoningParserManager.register_module("qwen3")(Markers)
    finally:
        del ReasoningParserManager.reasoning_parsers["test_only_markers"]


def test_reasoning_parser_name_checked_with_the_config():
    from atlas_vlm.config import EngineConfig

    with pytest.raises(ValueError, match="unknown reasoning_parser 'r1'; known parsers: deepseek_r1, qwen3"):
        EngineConfig(model="unused", reasoning_parser="r1")


def test_serve_reasoning_parser_choices_are_the_registry(capsys):
    from atlas_vlm.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "r1"])
    assert "invalid choice: 'r1' (choose from 'deepseek_r1', 'qwen3')" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
