"""Every answer is OpenAI's JSON whatever the bytes, the limits bind and are named, and the
schema says what the server answers (issue 16), on a tiny random Qwen2 served with
``--api-key``, ``--protect-docs-metrics``, ``--max-request-body-bytes 64KiB`` and
``--max-prompts-per-request 4``."""

from __future__ import annotations

import json

import httpx
import pytest

from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.text]

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny-qwen2"
COMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_models):
    s = ServerProcess(str(tiny_models["qwen2"][0]), "--kv-cache-memory", "16MiB", "--api-key", KEY,
                      "--protect-docs-metrics", "--max-request-body-bytes", "64KiB", "--max-prompts-per-request", "4",
                      name=NAME)
    yield s
    s.stop()


def post(server, route, payload=None, content=None, headers=None):
    kw = dict(json=payload) if content is None else dict(content=content)
    return httpx.post(server.url + route, headers={**AUTH, "content-type": "application/json", **(headers or {})},
                      timeout=60, **kw)


def error_of(r, status):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"model": "\\ud800", "prompt": "Hi"}', "model"),
    (b'{"model": "tiny-qwen2", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
    (b'{"model": "tiny-qwen2", "messages": [{"role": "user", "content": [{"type": "image_url", '
     b'"image_url": {"url": "data:image/png;base64,\\ud800"}}]}]}', "messages.0.content.0.image_url.url"),
])
def test_lone_surrogates_are_a_400_naming_the_field(server, raw, param):
    route = CHAT if b"messages" in raw else COMPL
    err = error_of(post(server, route, content=raw), 400)
    assert err["param"] == param and "lone surrogate" in err["message"]


@pytest.mark.parametrize(("route", "raw", "param"), [
    ("/v1/responses", b'{"model": "tiny-qwen2", "input": "\\ud800"}', "input"),
    ("/v1/embeddings", b'{"model": "tiny-qwen2", "input": ["ok", "\\udfff"]}', "input.1"),
])
def test_lone_surrogates_on_the_other_openai_routes(server, route, raw, param):
    err = error_of(post(server, route, content=raw), 400)
    assert err["param"] == param and "lone surrogate" in err["message"]


def test_lone_surrogates_on_the_anthropic_routes(server):
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        r = post(server, route, content=b'{"model": "tiny-qwen2", "max_tokens": 4, "system": "\\ud800", '
                                        b'"messages": [{"role": "user", "content": "Hi"}]}')
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and "system: a string holds a lone surrogate" in body["error"]["message"]


def test_bytes_that_are_not_json_or_not_utf8(server):
    err = error_of(post(server, COMPL, content=b'{"model": "tiny-qwen2", "prompt": "Hi",}'), 400)
    assert err["param"] is None and err["code"] == "invalid_json" and "invalid JSON body at byte" in err["message"]
    error_of(post(server, COMPL, content=b'{"prompt": "\xff\xfe"}'), 400)


# (n: 1.0 is an integer to JSON Schema, so the served schema allows it and the server takes it: issue 35)
@pytest.mark.parametrize(("field", "value"), [("max_tokens", "16"), ("stream", 1), ("prompt", [True, False]),
                                              ("temperature", "0.5"), ("n", 1.5)])
def test_types_are_strict_as_openai(server, field, value):
    err = error_of(post(server, COMPL, {"model": NAME, "prompt": "Hi", "max_tokens": 2, field: value}), 400)
    assert err["param"].split(".")[0] == field and err["type"] == "invalid_request_error"


def test_model_cards(server):
    cards = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert [c["id"] for c in cards] == [NAME] and cards[0]["root"].endswith("qwen2")
    card = httpx.get(server.url + f"/v1/models/{NAME}", headers=AUTH).json()
    assert card == cards[0]
    err = error_of(httpx.get(server.url + "/v1/models/nope", headers=AUTH), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_wrong_method_is_405_with_allow(server):
    r = httpx.get(server.url + COMPL, headers=AUTH)
    err = error_of(r, 405)
    assert err["type"] == "invalid_request_error" and r.headers["allow"] == "POST"


def test_body_limit_is_413_named(server):
    big = {"model": NAME, "prompt": "x" * (70 << 10), "max_tokens": 2}
    err = error_of(post(server, COMPL, big), 413)
    assert err["code"] == "request_too_large" and "--max-request-body-bytes" in err["message"]
    assert str(64 << 10) in err["message"]

    def chunks():  # no Content-Length: counted while read
        yield b'{"model": "tiny-qwen2", "prompt": "'
        for _ in range(80):
            yield b"y" * 1024
        yield b'"}'

    err = error_of(httpx.post(server.url + COMPL, content=chunks(), headers={**AUTH, "content-type": "application/json"},
                              timeout=60), 413)
    assert "--max-request-body-bytes" in err["message"]


def test_prompts_per_request_cap_is_named(server):
    err = error_of(post(server, COMPL, {"model": NAME, "prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "--max-prompts-per-request" in err["message"] and "5 prompts" in err["message"]
    r = post(server, COMPL, {"model": NAME, "prompt": ["a", "b", "c", "d"], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]


def test_docs_and_metrics_behind_the_key_health_open(server):
    for path in ("/docs", "/openapi.json", "/metrics", "/redoc"):
        err = error_of(httpx.get(server.url + path), 401)
        assert err["code"] == "invalid_api_key"
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert r.headers["content-type"] == "application/json"


def test_openapi_declares_what_the_server_answers(server):
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    for route in (COMPL, CHAT):
        responses = schema["paths"][route]["post"]["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "401", "404", "413", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref == "#/components/schemas/OpenAIError"
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "/v1/models/{model_id}" in schema["paths"]
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "prompt" in props and "max_tokens" in props


def test_key_still_guards_every_v1_route(server):
    for path in ("/v1/models", f"/v1/models/{NAME}"):
        assert httpx.get(server.url + path).status_code == 401
    assert httpx.post(server.url + COMPL, json={"model": NAME, "prompt": "Hi"}).status_code == 401
