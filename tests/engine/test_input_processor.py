"""``InputProcessor.process``: any prompt form -> a validated ``Request`` (length checks,
request id, seed = engine seed + arrival index when the request sets none), and
``LLMEngine.add_request`` as process -> duplicate check -> scheduler."""

from __future__ import annotations

import pytest

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.engine import RequestTooLongError
from atlas_vlm.engine.input_processor import InputProcessor, RequestTooLongError as FromProcessor
from atlas_vlm.request import Request

pytestmark = pytest.mark.text


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), max_model_len=64, num_kvcache_blocks=8, seed=100, dtype="float32")


def test_every_prompt_form_gives_a_request(llm):
    proc: InputProcessor = llm.engine.input_processor
    tok = llm.tokenizer
    text_ids = tok("Hello there")["input_ids"]
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, return_dict=False, add_generation_prompt=True)
    forms = [("Hello there", text_ids), ({"prompt": "Hello there"}, text_ids), ([5, 6, 7], [5, 6, 7]),
             ({"prompt_token_ids": [5, 6, 7]}, [5, 6, 7]),
             ({"messages": [{"role": "user", "content": "Hi"}]}, chat_ids)]
    first = next(proc._ids)
    for k, (prompt, ids) in enumerate(forms):
        req = proc.process(prompt, SamplingParams(max_tokens=None), request_id=None)
        assert isinstance(req, Request)
        assert req.request_id == str(first + 1 + k)
        assert req.token_ids == ids and req.num_prompt_tokens == len(ids)
        assert req.max_tokens == 64 - len(ids)  # max_tokens=None: the rest of max_model_len
        assert req.prompt == (prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None)
    assert not llm.engine.requests  # process() queues nothing


def test_seed_is_engine_seed_plus_arrival_index(llm):
    proc = llm.engine.input_processor
    a = proc.process([1, 2], SamplingParams(max_tokens=1))
    b = proc.process([1, 2], SamplingParams(max_tokens=1))
    assert b.generator.initial_seed() == a.generator.initial_seed() + 1 >= 100 + 1
    c = proc.process([1, 2], SamplingParams(max_tokens=1, seed=7))
    assert c.generator.initial_seed() == 7
    d = proc.process([1, 2], SamplingParams(max_tokens=1))
    assert d.generator.initial_seed() == b.generator.initial_seed() + 1  # an explicit seed takes no index


def test_length_checks_raise_before_anything_is_queued(llm):
    proc = llm.engine.input_processor
    assert RequestTooLongError is FromProcessor
    with pytest.raises(RequestTooLongError, match="max_model_len is 64"):
        proc.process(list(range(100, 170)))
    with pytest.raises(RequestTooLongError, match=r"\+ max_tokens \(10\) = 70 is over max_model_len 64"):
        proc.process(list(range(100, 160)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="the prompt is empty"):
        proc.process("")
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        proc.process([1, 2], {"max_tokens": 3})
    assert llm.engine.block_manager.num_free_blocks == 8 and not llm.engine.requests


def test_add_request_queues_the_processed_request(llm):
    engine = llm.engine
    rid = engine.add_request([3, 4, 5], SamplingParams(max_tokens=2), request_id="r1")
    assert rid == "r1" and engine.requests["r1"].token_ids == [3, 4, 5]
    with pytest.raises(ValueError, match="request id 'r1' is already in use"):
        engine.add_request([6], SamplingParams(max_tokens=1), request_id="r1")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.requests and engine.block_manager.num_free_blocks == 8
