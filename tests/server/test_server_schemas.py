"""Request JSON schemas checked when the request arrives, on the text server: a tool's invalid
``parameters`` is a 400 under every ``tool_choice`` naming the tool and the path inside its
schema (never the grammar built from it); ``response_format`` / the Responses API's
``text.format`` errors name their own field."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.server, pytest.mark.text]

BAD = {"type": "object", "properties": {"x": {"type": "strin"}}}
GOOD = {"type": "object", "properties": {"y": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "ok", "parameters": GOOD}},
         {"type": "function", "function": {"name": "bad", "parameters": BAD}}]
USER = [{"role": "user", "content": "hi"}]
WANT = "tools[1].function.parameters.properties.x.type: 'strin' is not valid under any of the given schemas"


def _error(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


@pytest.mark.parametrize("choice", ["none", "auto", "required", {"type": "function", "function": {"name": "ok"}}])
def test_invalid_tool_schema_is_refused_under_every_tool_choice(text_server, choice):
    client = text_server.client()
    err = _error(lambda: client.chat.completions.create(model=text_server.name, messages=USER, tools=TOOLS,
                                                        tool_choice=choice, max_tokens=2))
    assert err["message"] == WANT and err["param"] == "tools[1].function.parameters"
    assert "%json" not in err["message"] and "start:" not in err["message"]  # never our grammar


def test_response_format_and_text_format_errors_name_their_field(text_server):
    client = text_server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": BAD}}
    err = _error(lambda: client.chat.completions.create(model=text_server.name, messages=USER, response_format=rf,
                                                        max_tokens=2))
    assert err["param"] == "response_format.json_schema.schema"
    assert err["message"] == ("response_format.json_schema.schema.properties.x.type: 'strin' is not valid under any "
                              "of the given schemas")
    err = _error(lambda: client.responses.create(model=text_server.name, input="hi", max_output_tokens=16, text={
        "format": {"type": "json_schema", "name": "r", "schema": BAD}}))
    assert err["param"] == "text.format.schema" and err["message"].startswith("text.format.schema.properties.x.type: ")
    err = _error(lambda: client.responses.create(model=text_server.name, input="hi", max_output_tokens=16, tools=[
        {"type": "function", "name": "bad", "parameters": BAD}]))
    assert err["param"] == "tools[0].parameters" and err["message"].startswith("tools[0].parameters.properties.x.type")
    # valid for jsonschema, refused by the grammar backend: named as the field, not structured_outputs
    odd = {"type": "object", "properties": {"e": {"type": "string", "format": "idn-email"}}}
    err = _error(lambda: client.chat.completions.create(model=text_server.name, messages=USER, max_tokens=2,
                                                        response_format={"type": "json_schema", "json_schema": {
                                                            "name": "r", "schema": odd}}))
    assert err["param"] == "response_format.json_schema.schema" and "structured_outputs" not in err["message"]
    assert "idn-email" in err["message"]
