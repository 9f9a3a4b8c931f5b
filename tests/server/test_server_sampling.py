"""Sampling controls on the text server (the shared session fixture): ``logit_bias``,
``min_p`` and the penalties are taken by chat completions, completions and responses, and
a bad value is a 400 naming the field (the engine's own checks: ``test_logits_processors``)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.server, pytest.mark.text]

USER = [{"role": "user", "content": "Count: one two one two one two"}]
CONTROLS = dict(min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3)


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json={"model": "smollm2", **body}, timeout=60)


def test_logit_bias_forces_a_token_on_completions(text_server):
    tokens = {}
    for tid in (300, 301):
        r = post(text_server, "/v1/completions", dict(prompt="Hi", max_tokens=3, temperature=0, logprobs=0,
                                                       logit_bias={str(tid): 100}))
        assert r.status_code == 200, r.text
        tokens[tid] = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(set(tokens[tid])) == 1 and len(tokens[tid]) == 3  # the biased token every time
    assert tokens[300] != tokens[301]


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", dict(messages=USER, max_tokens=4, temperature=0.7, seed=1, **CONTROLS)),
    ("/v1/completions", dict(prompt="one two one two", max_tokens=4, n=2, seed=1, logit_bias={"5": -100},
                             **CONTROLS)),
    ("/v1/responses", dict(input="Count: one two one two", max_output_tokens=4, temperature=0, top_k=5,
                           store=False, logit_bias={"300": 100}, **CONTROLS)),
])
def test_every_route_takes_the_controls(text_server, route, body):
    r = post(text_server, route, body)
    assert r.status_code == 200, r.text


# the ranges are stated in the schema (pydantic refuses them, naming the field); whether a key is
# a token of this model is the engine's check
@pytest.mark.parametrize("route, body, param, words", [
    ("/v1/chat/completions", dict(messages=USER, repetition_penalty=0), "repetition_penalty", "greater than 0"),
    ("/v1/chat/completions", dict(messages=USER, min_p=1.5), "min_p", "less than or equal to 1"),
    ("/v1/chat/completions", dict(messages=USER, frequency_penalty=2.5), "frequency_penalty", "less than or equal to 2"),
    ("/v1/completions", dict(prompt="Hi", presence_penalty=-3), "presence_penalty", "greater than or equal to -2"),
    ("/v1/completions", dict(prompt="Hi", logit_bias={"1": 500}), "logit_bias.1", "less than or equal to 100"),
    ("/v1/completions", dict(prompt="Hi", logit_bias={"one": 1}), "logit_bias.one", "should match pattern"),
    ("/v1/chat/completions", dict(messages=USER, logit_bias={"99999999": 1}), "logit_bias",
     "not tokens of this model"),
    ("/v1/responses", dict(input="Hi", min_p=-1), "min_p", "greater than or equal to 0"),
])
def test_a_bad_value_is_a_400_naming_the_field(text_server, route, body, param, words):
    r = post(text_server, route, {"max_tokens": 2, **body} if route != "/v1/responses" else body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
