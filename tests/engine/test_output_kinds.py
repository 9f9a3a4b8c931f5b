"""``SamplingParams.output_kind`` (issue 24, vLLM's ``RequestOutputKind``) on the embedded
SmolLM2: DELTA outputs folded together equal the CUMULATIVE final output (text, ids,
logprobs) for a batch with a stop string and logprobs; FINAL_ONLY makes exactly one output;
after a request's first DELTA no output carries the prompt ids or the ids of earlier steps
(no per-step copy of the whole output); ``AsyncLLM`` streams DELTAs and counts every token."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from atlas_vlm import LLM, RequestOutput, RequestOutputKind, SamplingParams
from atlas_vlm.engine.async_llm import AsyncLLM
from atlas_vlm.entrypoints.openai.serving_common import output_kind

pytestmark = pytest.mark.text

PROMPTS = ["The capital of France is", "List three colors:", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, kv_cache_memory=32 << 20, dtype="float32")


def stream(llm, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Every output of one batched streamed call, per prompt (ids are numbered in add order)."""
    by_id: dict[str, list[RequestOutput]] = {}
    for out in llm.generate(PROMPTS, params, stream=True, use_tqdm=False):
        by_id.setdefault(out.request_id, []).append(out)
    assert len(by_id) == len(PROMPTS)
    return dict(zip(PROMPTS, (by_id[rid] for rid in sorted(by_id, key=int))))


@pytest.fixture(scope="module")
def params(llm):
    """Greedy params per prompt: logprobs on two of them, and on one a stop string taken from
    the middle of that prompt's own greedy text (so the stop really ends it)."""
    base = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2 if i % 2 else None)
            for i in range(len(PROMPTS))]
    text = llm.generate(PROMPTS[1], base[1], use_tqdm=False)[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    base[1] = dataclasses.replace(base[1], stop=[stop])
    return base


def with_kind(params, kind):
    return [dataclasses.replace(p, output_kind=kind) for p in params]


def test_delta_outputs_folded_equal_the_cumulative_final_output(llm, params):
    cumulative = stream(llm, params)
    delta = stream(llm, with_kind(params, RequestOutputKind.DELTA))
    assert cumulative[PROMPTS[1]][-1].finish_reason == "stop"  # the stop string ended it early
    assert len(cumulative[PROMPTS[1]][-1].token_ids) < 24
    for prompt in PROMPTS:
        final, deltas = cumulative[prompt][-1], delta[prompt]
        assert len(deltas) == len(cumulative[prompt])  # one output per step, as CUMULATIVE
        folded = dataclasses.replace(deltas[0], token_ids=list(deltas[0].token_ids),
                                     logprobs=None if deltas[0].logprobs is None else list(deltas[0].logprobs),
                                     top_logprobs=None if deltas[0].top_logprobs is None
                                     else list(deltas[0].top_logprobs))
        for d in deltas[1:]:
            folded.add(d)
        assert folded.text == "".join(d.text for d in deltas) == final.text
        assert folded.token_ids == final.token_ids and folded.prompt_token_ids == final.prompt_token_ids
        assert folded.logprobs == final.logprobs and folded.top_logprobs == final.top_logprobs
        assert folded.finish_reason == final.finish_reason == deltas[-1].finish_reason
        if final.logprobs is not None:
            assert len(final.logprobs) == len(final.token_ids) > 0


def test_delta_outputs_after_the_first_carry_only_the_steps_new_entries(llm, params):
    delta = stream(llm, with_kind(params, RequestOutputKind.DELTA))
    for prompt in PROMPTS:
        first, *rest = delta[prompt]
        assert first.prompt_token_ids == llm.tokenizer.encode(prompt) and len(rest) > 3
        for out in rest:
            assert out.prompt_token_ids == []  # the prompt went with the first output only
            assert out.token_ids == out.new_token_ids and len(out.token_ids) == 1  # decode: one id per step
            assert out.text == out.new_text
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.top_logprobs) == 1


def test_final_only_makes_exactly_one_output_equal_to_the_cumulative_final(llm, params):
    cumulative = stream(llm, params)
    final_only = stream(llm, with_kind(params, RequestOutputKind.FINAL_ONLY))
    for prompt in PROMPTS:
        (only,) = final_only[prompt]
        final = cumulative[prompt][-1]
        assert only.finished and (only.text, only.token_ids, only.logprobs, only.finish_reason) == \
            (final.text, final.token_ids, final.logprobs, final.finish_reason)
    # LLM.generate without a stream asks for FINAL_ONLY itself; the caller's params stay as given
    whole = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.text for o in whole] == [cumulative[p][-1].text for p in PROMPTS]
    assert all(p.output_kind is RequestOutputKind.CUMULATIVE for p in params)


def test_output_kind_is_checked_and_the_server_picks_delta_for_streams():
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
    assert output_kind(True, 1, 0) is RequestOutputKind.DELTA
    assert output_kind(False, 1, 0) is RequestOutputKind.FINAL_ONLY
    assert [output_kind(False, 3, i) for i in range(3)] == [RequestOutputKind.DELTA] + [RequestOutputKind.FINAL_ONLY] * 2


class _Stats:
    def __init__(self):
        self.first, self.tokens, self.finished = [], 0, []

    def on_step(self, stats, batch_size):
        pass

    def on_first_token(self, seconds, num_prompt_tokens, num_cached_tokens):
        self.first.append(num_prompt_tokens)

    def on_new_tokens(self, n, seconds_per_token):
        self.tokens += n

    def on_finish(self, output):
        self.finished.append(output.finish_reason)


def test_async_llm_streams_deltas_and_counts_every_token(llm):
    stats = _Stats()
    front = AsyncLLM(llm.engine, stat_logger=stats)
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)

    async def scenario():
        d = await front.add_request(PROMPTS[0], SamplingParams(**greedy, output_kind=RequestOutputKind.DELTA), "d")
        f = await front.add_request(PROMPTS[2], SamplingParams(**greedy, output_kind=RequestOutputKind.FINAL_ONLY), "f")
        return [o async for o in d], [o async for o in f]

    try:
        deltas, finals = asyncio.run(scenario())
    finally:
        front.shutdown()
        assert front.join(30)
        llm.engine.runner.observers.remove(front._observe_forward)
    ref = llm.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(**greedy), use_tqdm=False)
    assert sum((o.token_ids for o in deltas), []) == ref[0].token_ids and len(deltas) == 12
    assert all(o.prompt_token_ids == [] for o in deltas[1:])
    assert len(finals) == 1 and finals[0].token_ids == ref[1].token_ids
    # both requests' 12 tokens counted, each first token once (FINAL_ONLY's before it ended)
    assert stats.tokens == 24 and sorted(stats.first) == sorted(len(r.prompt_token_ids) for r in ref)
    assert stats.finished == ["length", "length"]


def test_processor_abort_outputs_per_kind(llm):
    """An abort (``OutputProcessor.finish``): a DELTA request ends with an empty delta, a
    FINAL_ONLY one with its only output holding the text released so far."""
    from types import SimpleNamespace

    from atlas_vlm.engine.output_processor import OutputProcessor

    ids = llm.tokenizer.encode(" one two three four", add_special_tokens=False)
    outs = {}
    for kind in RequestOutputKind:
        proc = OutputProcessor(llm.tokenizer)
        req = SimpleNamespace(request_id="r", finish_reason=None, error=None, logprobs=[], top_logprobs=[],
                              sampling_params=SamplingParams(logprobs=0, output_kind=kind))
        proc.add_request("r", None, [7, 8], [], kind)
        steps = []
        for t in ids:
            req.logprobs.append(-1.0)
            req.top_logprobs.append({t: -1.0})
            steps.append(proc.process(req, [t])[0])
        req.finish_reason = "abort"
        outs[kind] = (steps, proc.finish(req))
        assert not proc.states
    cumulative = outs[RequestOutputKind.CUMULATIVE][1]
    assert cumulative.token_ids == ids and cumulative.text == llm.tokenizer.decode(ids)
    steps, last = outs[RequestOutputKind.DELTA]
    assert (last.text, last.token_ids, last.logprobs, last.prompt_token_ids) == ("", [], [], [])
    assert steps[0].prompt_token_ids == [7, 8] and "".join(s.text for s in steps) == cumulative.text
    steps, last = outs[RequestOutputKind.FINAL_ONLY]
    assert steps == [None] * len(ids) and last.finish_reason == "abort"
    assert (last.text, last.token_ids, last.logprobs) == (cumulative.text, ids, [-1.0] * len(ids))
    with pytest.raises(ValueError, match="cannot add an output of request 'x'"):
        cumulative.add(RequestOutput("x", None, []))


def test_a_delta_stream_cut_by_shutdown_ends_with_an_empty_delta(llm):
    front = AsyncLLM(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def scenario():
        s = await front.add_request(PROMPTS[3], params, "cut")
        outs = []
        async for out in s:
            outs.append(out)
            if len(outs) == 3:
                front.shutdown()
        return outs

    try:
        outs = asyncio.run(scenario())
    finally:
        front.shutdown()
        assert front.join(30)
        llm.engine.runner.observers.remove(front._observe_forward)
    last = outs[-1]
    assert last.finish_reason == "abort" and 3 <= len(outs) < 200 and outs[0].prompt_token_ids
    assert (last.text, last.token_ids, last.prompt_token_ids) == ("", [], [])
    assert all(not o.finished for o in outs[:-1])
