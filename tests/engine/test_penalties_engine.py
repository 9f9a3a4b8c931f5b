"""Logit bias, penalties and min-p through the engine on a tiny random Qwen2 (fp32): a batch
mixing them equals each request alone; a strong repetition penalty never repeats a token;
n-gram speculation with penalties gives the undrafted tokens (greedy), also with copies of
one prompt and preemption; they compose with grammars and with drafted sampled rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.spec_decode.rejection import sample_with_drafts
from atlas_vlm.worker.sampler import sample

pytestmark = pytest.mark.text
BASE = dict(max_model_len=512, kvcache_block_size=4, num_kvcache_blocks=512, device="cpu", dtype="float32")
PROMPTS = ["a b c d a b c d a b c d a b c", "one two three four five six seven eight nine ten one two three",
           "Hello"]


def greedy(max_tokens=20, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def folder(tiny_models):
    return tiny_models["qwen2"][0]


@pytest.fixture(scope="module")
def plain(folder):
    return LLM(str(folder), **BASE)


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_a_batch_mixing_penalties_equals_each_request_alone(plain):
    params = [greedy(repetition_penalty=1.5), greedy(frequency_penalty=1.2, presence_penalty=0.6),
              SamplingParams(temperature=0.8, min_p=0.05, seed=5, max_tokens=20, ignore_eos=True,
                             logit_bias={10: 4.0, 11: -50.0}, presence_penalty=-0.5),
              greedy(logprobs=2)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2]]
    batch = gen(plain, prompts, params)
    for p, pr, b in zip(prompts, params, batch):
        alone = gen(plain, [p], pr)[0]
        assert alone.token_ids == b.token_ids
    assert batch[0].token_ids != gen(plain, PROMPTS[0], greedy())[0].token_ids  # the penalty changed something


def test_strong_repetition_penalty_never_repeats_a_token(plain):
    ids = plain.generate(PROMPTS[0], greedy(30), use_tqdm=False)[0]
    assert len(set(ids.token_ids)) < len(ids.token_ids), "the model does not repeat: the test covers nothing"
    out = gen(plain, PROMPTS[0], greedy(30, repetition_penalty=1e6, presence_penalty=2.0))[0]
    seen = set(out.prompt_token_ids)
    for t in out.token_ids:
        assert t not in seen
        seen.add(t)


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=3),
                                dict(num_speculative_tokens=4, num_kvcache_blocks=40, enable_prefix_caching=False)])
def test_ngram_speculation_with_penalties_equals_plain_decode(folder, plain, kw):
    params = [greedy(30, presence_penalty=-1.0), greedy(30, repetition_penalty=1.3),
              greedy(30, frequency_penalty=0.4, logit_bias={5: 2.0}), greedy(30)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    if "enable_prefix_caching" in kw:  # copies of one prompt under a block budget that preempts
        prompts, params = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2, [params[0]] * 3 + [params[2]] * 2
    ref = gen(plain, prompts, params)
    llm = LLM(str(folder), speculative="ngram", speculative_disable_by_batch_size=None, **{**BASE, **kw})
    out = gen(llm, prompts, params)
    for r, o in zip(ref, out):
        assert o.token_ids == r.token_ids
    assert llm.engine.scheduler.spec_decode_stats["accepted"] > 0, "no draft accepted: the test covers nothing"
    if "enable_prefix_caching" in kw:
        assert llm.engine.scheduler.num_preemptions > 0, "the block budget did not force a preemption"


def test_grammar_choice_with_logit_bias(plain):
    constrained = dict(structured_outputs={"choice": ["yes", "no"]}, max_tokens=8)
    for word in ("yes", "no"):  # the bias picks the answer; the grammar still ends it
        first = plain.tokenizer(word, add_special_tokens=False)["input_ids"][0]
        out = gen(plain, PROMPTS[2], SamplingParams(temperature=0, logit_bias={first: 100.0}, **constrained))[0]
        assert out.text == word and out.finish_reason == "stop"


def fake(params, token_ids, drafts=(), rid="r", seed=0):
    return SimpleNamespace(request_id=rid, sampling_params=params, token_ids=list(token_ids) + list(drafts),
                           num_prompt_tokens=1, spec_token_ids=list(drafts),
                           generator=torch.Generator().manual_seed(seed))


def test_masked_rows_and_drafted_sampled_rows_are_penalised():
    vocab = 40
    logits = torch.zeros(3, vocab)
    logits[:, 4] = 10.0  # the drafted token dominates every row unless its bias lands
    params = SamplingParams(temperature=1.0, logit_bias={4: -100.0})
    r = fake(params, [1, 2], drafts=[4, 4])
    for seed in range(5):
        r.generator = torch.Generator().manual_seed(seed)
        out = sample_with_drafts(logits, [r] * 3)
        assert out.errors == [None] * 3 and 4 not in out.token_ids
    # a grammar allows tokens 2 and 3 only: the bias lifts 3 above 2, the banned 9 stays banned
    one = torch.zeros(1, vocab)
    one[0, 2], one[0, 9] = 1.0, 50.0
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    mask[0, 0] = (1 << 2) | (1 << 3)
    g = fake(SamplingParams(temperature=0, logit_bias={3: 5.0, 9: 100.0}), [1])
    assert sample(one, [g], ([0], mask)).token_ids == [3]
