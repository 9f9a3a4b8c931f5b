"""The ``/v1/responses`` store without a server: bounded (oldest dropped first), 404s naming
the field, conversations handed out as copies; and the request translation's error params."""

from __future__ import annotations

import pytest

from atlas_vlm.entrypoints.openai.protocol import APIError
from atlas_vlm.entrypoints.openai.responses.protocol import ResponsesRequest
from atlas_vlm.entrypoints.openai.responses.store import ResponseStore
from atlas_vlm.entrypoints.openai.responses.translate import chat_request, responses_param

pytestmark = [pytest.mark.text]


def test_store_drops_the_oldest_beyond_its_bound():
    store = ResponseStore(max_stored=2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    assert len(store) == 2 and store.response("resp_2") == {"id": "resp_2"}
    with pytest.raises(APIError) as e:
        store.response("resp_0")
    assert e.value.status == 404 and e.value.param is None
    with pytest.raises(APIError) as e:
        store.conversation("resp_0")
    assert e.value.param == "previous_response_id"


def test_conversation_is_a_copy_and_delete_forgets():
    store = ResponseStore()
    store.put({"id": "resp_a"}, [{"role": "user", "content": "hi"}])
    store.conversation("resp_a")[0]["content"] = "changed"
    assert store.conversation("resp_a") == [{"role": "user", "content": "hi"}]
    assert store.delete("resp_a") == {"id": "resp_a", "object": "response.deleted", "deleted": True}
    with pytest.raises(APIError):
        store.delete("resp_a")
    with pytest.raises(ValueError, match="max_stored"):
        ResponseStore(max_stored=0)


def test_translation_to_chat():
    req = ResponsesRequest.model_validate({
        "input": [{"role": "developer", "content": "terse"},
                  {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                               {"type": "input_image", "image_url": "data:x"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "1"}],
        "instructions": "sys", "max_output_tokens": 5,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}})
    chat = chat_request(req, [{"role": "user", "content": "before"}])
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "system", "user", "assistant", "tool"]
    assert chat.messages[0].content == "sys" and chat.messages[2].content == "terse"
    assert [p.type for p in chat.messages[3].content] == ["text", "image_url"]
    assert [c.id for c in chat.messages[4].tool_calls] == ["c1", "c2"]
    assert chat.max_completion_tokens == 5 and chat.tools[0].function.name == "f"
    assert chat.tool_choice.function.name == "f"
    assert responses_param("messages.3.content") == "input"
    assert responses_param("response_format") == "text.format"
