"""``atlas-vlm serve --tool-call-parser`` through the ``openai`` client: a tiny random Qwen2
(Qwen's template, which alone would pick ``hermes``) served with ``--tool-call-parser
mistral``; its reply is forced (``guided_choice``) to a Mistral-format call, which comes back
as ``tool_calls``, whole and streamed; ``tool_choice="required"`` forces the bare JSON list,
read back with schema-valid arguments; an unknown parser name is refused at start."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from server_process import TEXT_ARGS, ServerProcess
from test_server_structured import _collect_stream

pytestmark = [pytest.mark.server, pytest.mark.text]

PARAMS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False},
          "zoom": {"type": "object", "properties": {"factor": {"enum": [1, 2, 4]}}, "required": ["factor"],
                   "additionalProperties": False}}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in PARAMS.items()]
ASK = [{"role": "user", "content": "Zoom in."}]
REPLY = '[TOOL_CALLS] [{"name": "zoom", "arguments": {"factor": 2}}]'


@pytest.fixture(scope="module")
def mistral_server(tiny_models):
    server = ServerProcess(str(tiny_models["qwen2"][0]), *TEXT_ARGS, "--tool-call-parser", "mistral", name="tiny")
    yield server
    server.stop()


def test_tool_call_parser_flag_is_honoured(mistral_server):
    client = mistral_server.client()
    ask = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
               extra_body={"guided_choice": [REPLY]})
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("zoom", {"factor": 2})]
    content, streamed, finish = _collect_stream(client.chat.completions.create(stream=True, **ask))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("zoom", {"factor": 2})]
    # without tools the same text is plain content
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                                           extra_body={"guided_choice": [REPLY]}).choices[0]
    assert plain.message.content == REPLY and plain.message.tool_calls is None


def test_required_forces_the_bare_json_list(mistral_server):
    client = mistral_server.client()
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=0).choices[0]
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_unknown_parser_refused_listing_the_known_ones():
    proc = subprocess.run([sys.executable, "-m", "atlas_vlm.serve", "--tool-call-parser", "pythonic"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "invalid choice: 'pythonic'" in proc.stderr and "hermes" in proc.stderr and "qwen3_coder" in proc.stderr
