"""Fuzzing in the suite (issue 16), bounded: schemathesis over the server's own OpenAPI schema
(fixed seed, at most ``FUZZ_EXAMPLES`` cases per operation, ``max_tokens`` / ``n`` capped)
asserting no 5xx, responses that match the declared statuses, content types and schemas;
then every check schemathesis has (``--checks all``, issue 35) on positive and negative cases
of every operation, and the schema stating each rule the server enforces; then a soak of
``SOAK_CLIENTS`` concurrent clients for ``SOAK_S`` seconds mixing chat and completions,
streamed and not, with random disconnects, asserting no 5xx and greedy answers equal to the
references. After each: every KV block back, nothing running or waiting, and a correct answer.
On a tiny random Qwen2 (``--max-model-len 64``)."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.text]

schemathesis = pytest.importorskip("schemathesis")
import schemathesis.specs.openapi.checks  # noqa: E402  (registers the OpenAPI checks: the `--checks all` set)
from hypothesis import HealthCheck, Phase, settings  # noqa: E402 - after the importorskip
from hypothesis.errors import Unsatisfiable  # noqa: E402

NAME = "tiny-qwen2"
FUZZ_EXAMPLES = 60  # per operation (9 operations; 4 take a body)
SOAK_CLIENTS, SOAK_S = 16, 30
MAX_TOKENS, MAX_N = 8, 2
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello, my name is"]


@pytest.fixture(scope="module")
def fuzz_server(tiny_models):
    server = ServerProcess(str(tiny_models["qwen2"][0]), "--kv-cache-memory", "16MiB", "--max-model-len", "64",
                           "--dtype", "float32", name=NAME)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def references(fuzz_server):
    """Greedy completions of ``PROMPTS`` before any fuzzing: the answers that must not change."""
    out = {}
    for p in PROMPTS:
        r = httpx.post(fuzz_server.url + "/v1/completions", timeout=60,
                       json={"model": NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
        out[p] = r.json()["choices"][0]["text"]
    return out


def assert_idle_and_correct(server, references):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["atlas:num_requests_running"] == 0 and m["atlas:num_requests_waiting"] == 0 \
                and m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]:
            break
        time.sleep(0.2)
    m = server.metrics()
    assert m["atlas:num_requests_running"] == 0 and m["atlas:num_requests_waiting"] == 0
    assert m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for p, text in references.items():
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text


CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance, schemathesis.checks.response_schema_conformance]


def _cap(case) -> None:
    """Bound the work one case asks for (the fuzzer would ask for long generations)."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), (int, float)) and not isinstance(body.get(key), bool):
                body[key] = max(1, min(int(body[key]), MAX_TOKENS))  # 4.0 is an integer to JSON Schema
        path = case.operation.path
        if "max_tokens" not in body and path in ("/v1/chat/completions", "/v1/messages"):
            body["max_tokens"] = MAX_TOKENS
        if "max_output_tokens" not in body and path == "/v1/responses":
            body["max_output_tokens"] = MAX_TOKENS
        if isinstance(body.get("n"), (int, float)) and not isinstance(body.get("n"), bool):
            body["n"] = max(1, min(int(body["n"]), MAX_N))
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
            body["prompt"] = body["prompt"][:4]
        if isinstance(body.get("model"), str) and len(body["model"]) % 3:  # most cases reach the engine
            body["model"] = NAME


def test_schemathesis_no_5xx_and_schema_conformance(fuzz_server, references):
    """Every operation of the served schema, ``FUZZ_EXAMPLES`` cases each, derandomized (the
    same cases every run). Driven through hypothesis directly: schemathesis' pytest plugin
    does not run under this pytest."""
    from hypothesis import given

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}"}
    counts = {}
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            _cap(case)
            case.call_and_validate(base_url=fuzz_server.url, checks=CHECKS, timeout=60)
            counts[op.label] = counts.get(op.label, 0) + 1

        run()
    assert len(counts) == len(operations) and all(n >= 1 for n in counts.values())


ALL_CHECKS_EXAMPLES = 3  # per operation and generation mode (positive, negative)
# 400s for rules a JSON schema cannot state (a relation between two values of the request, the
# prompt's length in tokens, the server's media policy): schema-valid bodies the server may
# refuse, for which only ``positive_data_acceptance`` is waived
UNSTATABLE = [r"max_model_len is \d+", r"is over max_model_len \d+", r"list of ids in \[0, \d+\)",
              r"which is not in tools", r"local (image|video) files are refused", r"best_of \(\d+\) different from n",
              r"logit_bias keys \[[\d, ]+\] are not tokens of this model",
              r"token id \d+ is not in this model's vocabulary",  # /detokenize: the vocabulary's size
              r"this JSON schema is not supported by the server",
              r"(guided_grammar|guided_regex|structured_outputs\.(grammar|regex))(\.grammar)? is not supported: "]
# (the last two: a tool schema / a grammar or regex the grammar backend cannot compile)


def test_schemathesis_all_checks_every_operation(fuzz_server):
    """Every check schemathesis registers (``st run --checks all``) over every operation, on
    ``ALL_CHECKS_EXAMPLES`` positive and negative cases each, derandomized: schema-valid bodies
    are accepted (but for ``UNSTATABLE`` rules), schema-invalid ones refused, responses as
    declared. The coverage phase's OPTIONS probe is ``test_options_allow_lists_every_documented_method``."""
    from hypothesis import given
    from schemathesis.checks import CHECKS
    from schemathesis.generation.modes import GenerationMode

    checks = CHECKS.get_all()
    waived = [c for c in checks if c.__name__ != "positive_data_acceptance"]
    assert len(waived) == len(checks) - 1
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    failures, counts = [], {}
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=ALL_CHECKS_EXAMPLES, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case):
                _cap(case)
                response = case.call(base_url=fuzz_server.url, timeout=60)
                unstatable = response.status_code == 400 and any(re.search(p, response.text) for p in UNSTATABLE)
                try:
                    case.validate_response(response, checks=waived if unstatable else checks)
                except BaseException as e:  # schemathesis' FailureGroup
                    kinds = sorted(set(re.findall(r"- (ST\d+ [^\n]+)", str(e))))
                    failures.append(f"{op.label} ({mode.value}) {kinds}: {response.status_code} {response.text[:300]}")
                counts[op.label] = counts.get(op.label, 0) + 1

            try:
                run()
            except Unsatisfiable:  # no negative case exists (an operation without parameters)
                assert mode is GenerationMode.NEGATIVE
    assert not failures, "\n".join(failures)
    assert len(counts) == len(operations)


def _body_schema(spec: dict, path: str, media: str = "application/json"):
    """A validator of ``POST path``'s body schema as served (its ``$ref`` resolved in ``spec``)."""
    import jsonschema

    ref = spec["paths"][path]["post"]["requestBody"]["content"][media]["schema"]["$ref"]
    return jsonschema.Draft202012Validator({"$ref": ref, "components": spec["components"]})


CHAT_BODY = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION_BODY = {"model": NAME, "prompt": "Hi", "max_tokens": 1}
# issue 35 item 9: bodies the server refuses, each for a rule the served schema now states
STATED_RULES = [
    ("/v1/chat/completions", {**CHAT_BODY, "guided_regex": "a", "guided_choice": ["a"]}),  # one constraint
    ("/v1/chat/completions", {**CHAT_BODY, "response_format": {"type": "json_object"}, "guided_regex": "a"}),
    ("/v1/chat/completions", {**CHAT_BODY, "tool_choice": "auto"}),  # tool_choice needs tools
    ("/v1/chat/completions", {**CHAT_BODY, "tool_choice": "required", "guided_regex": "a",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}),  # forced + constraint
    ("/v1/completions", {**COMPLETION_BODY, "top_p": 1e-46}),  # rounds to 0 in float32
    ("/v1/completions", {**COMPLETION_BODY, "temperature": 1e39}),  # inf in float32
    ("/v1/completions", {**COMPLETION_BODY, "suffix": "x"}),  # not supported
    ("/v1/chat/completions", {**CHAT_BODY, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("/v1/embeddings", {"model": NAME}),  # neither input nor messages
    ("/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/models", "completion_window": "24h"}),
    ("/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "1h"}),
    ("/v1/messages", {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}],
                      "tool_choice": {"type": "tool"}}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "tool"}}),
    ("/v1/responses", {"model": NAME, "input": "Hi", "max_output_tokens": 1,
                       "text": {"format": {"type": "json_schema", "name": "x"}}}),
    ("/v1/responses", {"model": NAME, "input": "Hi", "max_output_tokens": 1, "tool_choice": "required"}),
    ("/v1/responses", {"model": NAME, "input": "Hi", "max_output_tokens": 1, "background": True, "stream": True}),
]
# and bodies the schema allows that the server once refused, now accepted
ACCEPTED = [
    ("/v1/completions", {**COMPLETION_BODY, "top_p": 1.5e-45}),  # float32's least subnormal
    ("/v1/chat/completions", {**CHAT_BODY, "mm_processor_kwargs": {"min_pixels": 2, "max_pixels": 1}}),
    ("/v1/embeddings", {"model": NAME, "input": "Hi", "mm_processor_kwargs": {"min_pixels": 9, "max_pixels": 4}}),
    ("/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "developer", "content": "Be brief."},
                                                        {"role": "user", "content": "Hi"}]}),
]


def test_the_schema_states_the_rules_the_server_enforces(fuzz_server):
    """Each refused body is invalid by the served schema, each accepted one valid (the rules
    schemathesis' ``positive_data_acceptance`` found unstated)."""
    spec = httpx.get(fuzz_server.url + "/openapi.json").json()
    for path, body in STATED_RULES:
        assert not _body_schema(spec, path).is_valid(body), (path, body)
        r = httpx.post(fuzz_server.url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
    for path, body in ACCEPTED:
        assert _body_schema(spec, path).is_valid(body), (path, body)
        r = httpx.post(fuzz_server.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, body, r.text)
    upload = _body_schema(spec, "/v1/files", "multipart/form-data")
    assert not upload.is_valid({"file": "x", "purpose": ""}) and upload.is_valid({"file": "x", "purpose": "batch"})
    r = httpx.post(fuzz_server.url + "/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": ""})
    assert r.status_code == 400, r.text


def test_options_allow_lists_every_documented_method(fuzz_server):
    """A wrong method on a path served by several routes (``GET`` and ``POST /v1/batches``)
    is a 405 whose ``Allow`` lists every method the schema documents for the path."""
    spec = httpx.get(fuzz_server.url + "/openapi.json").json()
    for path, ops in spec["paths"].items():
        url = fuzz_server.url + path.replace("{model_id}", NAME).replace("{", "").replace("}", "")
        r = httpx.options(url)
        assert r.status_code == 405, (path, r.status_code)
        allow = {m.strip() for m in r.headers["allow"].split(",")} - {"HEAD"}
        assert allow == {m.upper() for m in ops}, (path, allow)


def test_after_fuzzing_no_block_is_held_and_answers_are_right(fuzz_server, references):
    assert_idle_and_correct(fuzz_server, references)


async def _client(i: int, url: str, references: dict, deadline: float, stats: dict) -> None:
    rng = random.Random(1000 + i)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.monotonic() < deadline:
            prompt = rng.choice(PROMPTS)
            stream, chat = rng.random() < 0.5, rng.random() < 0.3
            greedy = rng.random() < 0.5
            disconnect = rng.random() < 0.3
            body = {"model": NAME, "max_tokens": MAX_TOKENS, "temperature": 0 if greedy else 0.8,
                    "n": 1 if greedy else rng.choice([1, 2]), "stream": stream}
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
                route = "/v1/chat/completions"
            else:
                body["prompt"] = prompt
                route = "/v1/completions"
            try:
                if stream:
                    async with client.stream("POST", route, json=body) as resp:
                        stats["statuses"].append(resp.status_code)
                        n = 0
                        async for line in resp.aiter_lines():
                            n += line.startswith("data: ")
                            if disconnect and n >= rng.randint(1, 3):
                                stats["disconnects"] += 1
                                break  # leaving the block closes the connection mid-stream
                else:
                    timeout = rng.uniform(0.01, 0.3) if disconnect else 60
                    r = await client.post(route, json=body, timeout=timeout)
                    stats["statuses"].append(r.status_code)
                    if greedy and not chat and r.status_code == 200:
                        stats["checked"] += 1
                        if r.json()["choices"][0]["text"] != references[prompt]:
                            stats["wrong"].append((prompt, r.json()["choices"][0]["text"]))
            except httpx.TimeoutException:
                stats["disconnects"] += 1


def test_soak_with_random_disconnects(fuzz_server, references):
    stats = {"statuses": [], "disconnects": 0, "checked": 0, "wrong": []}
    deadline = time.monotonic() + SOAK_S

    async def main():
        await asyncio.gather(*(_client(i, fuzz_server.url, references, deadline, stats)
                               for i in range(SOAK_CLIENTS)))

    asyncio.run(asyncio.wait_for(main(), SOAK_S + 120))
    assert stats["statuses"] and all(s == 200 for s in stats["statuses"]), sorted(set(stats["statuses"]))
    assert stats["disconnects"] > 0 and stats["checked"] > 0 and stats["wrong"] == []
    assert_idle_and_correct(fuzz_server, references)
