"""Logit bias, penalties and min-p (``worker.logits_processors``) in fp32 on random logits:
equal to transformers' ``RepetitionPenaltyLogitsProcessor`` / ``MinPLogitsWarper`` and to
OpenAI's frequency / presence formula; a batch mixing values equals each row alone; drafted
rows count the drafts before them; bad values are refused naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from atlas_vlm import SamplingParams
from atlas_vlm.sampling_params import SamplingParamsError, check_for_model
from atlas_vlm.worker.logits_processors import apply_min_p, apply_penalties, history_lengths
from atlas_vlm.worker.sampler import sample

pytestmark = pytest.mark.text
VOCAB = 50


def req(params: SamplingParams, prompt: list[int], output: list[int], drafts=(), rid="r"):
    return SimpleNamespace(request_id=rid, sampling_params=params, token_ids=prompt + output + list(drafts),
                           num_prompt_tokens=len(prompt), spec_token_ids=list(drafts), generator=None)


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, VOCAB, generator=g) * 3
    prompt = torch.randint(0, VOCAB, (7,), generator=g).tolist()
    output = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    return logits, prompt, output


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(seed, penalty):
    logits, prompt, output = random_case(seed)
    ours, rows = apply_penalties(logits, [req(SamplingParams(repetition_penalty=penalty), prompt, output)])
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    assert rows == [0] and torch.equal(ours, ref)


@pytest.mark.parametrize("seed", range(3))
def test_frequency_presence_and_bias_follow_openai_on_output_tokens_only(seed):
    logits, prompt, output = random_case(seed)
    bias = {prompt[0]: 5.5, output[0]: -100.0, 3: 0.25}
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-1.5, logit_bias=bias)
    ours, _ = apply_penalties(logits, [req(params, prompt, output)])
    ref = logits.clone()
    for t, b in bias.items():
        ref[0, t] += b
    count = torch.bincount(torch.tensor(output), minlength=VOCAB).float()  # the prompt never counts
    ref[0] -= 0.7 * count + -1.5 * (count > 0)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_equals_transformers(seed, min_p):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    ours = apply_min_p(logits, torch.tensor([min_p, min_p]))
    ref = MinPLogitsWarper(min_p)(None, logits.clone()) if min_p > 0 else logits
    assert torch.equal(ours, ref)


def test_a_mixed_batch_equals_each_row_alone_and_leaves_plain_rows_untouched():
    cases = [random_case(s) for s in range(4)]
    params = [SamplingParams(repetition_penalty=1.4), SamplingParams(),
              SamplingParams(frequency_penalty=1.0, logit_bias={7: 3.0}), SamplingParams(presence_penalty=2.0)]
    reqs = [req(p, c[1], c[2], rid=str(i)) for i, (p, c) in enumerate(zip(params, cases))]
    batch = torch.cat([c[0] for c in cases])
    out, rows = apply_penalties(batch, reqs)
    assert rows == [0, 2, 3]
    for i, r in enumerate(reqs):
        alone, _ = apply_penalties(cases[i][0], [r])
        assert torch.equal(out[i], alone[0])
    assert torch.equal(out[1], batch[1])
    assert apply_penalties(batch, [reqs[1]] * 4)[0] is batch  # nobody uses them: nothing computed


def test_drafted_rows_count_the_drafts_before_them():
    prompt, output, drafts = [1, 2], [3, 4], [5, 5, 6]
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)
    r = req(params, prompt, output, drafts)
    other = req(SamplingParams(), [9], [])
    assert history_lengths([other, r, r, r, r, other]) == [1, 4, 5, 6, 7, 1]
    logits = torch.rand(4, VOCAB) + 1.0  # positive: the repetition penalty divides
    out, _ = apply_penalties(logits, [r] * 4)
    for j in range(4):  # row j equals the undrafted request whose output holds drafts[:j]
        alone, _ = apply_penalties(logits[j:j + 1], [req(params, prompt, output + drafts[:j])])
        assert torch.equal(out[j], alone[0])


def test_greedy_sample_picks_from_the_penalised_logits_and_reports_raw_logprobs():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 8] = 2.0, 1.0
    r = req(SamplingParams(temperature=0, repetition_penalty=4.0, logprobs=0), [4], [])
    out = sample(logits, [r])
    assert out.token_ids == [8]  # 2 / 4 < 1
    assert out.logprobs[0] == pytest.approx(float(logits.log_softmax(-1)[0, 8]))
    banned = req(SamplingParams(temperature=0, logit_bias={4: -100.0, 8: -100.0}), [1], [])
    assert sample(logits, [banned]).token_ids[0] not in (4, 8)


def test_sampled_rows_keep_only_the_min_p_set():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    for seed in range(20):
        r = req(SamplingParams(temperature=1.0, min_p=0.5), [0], [])
        r.generator = torch.Generator().manual_seed(seed)
        assert sample(logits, [r]).token_ids[0] in (0, 1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"),
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3.0), "presence_penalty"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field
    with pytest.raises(ValueError, match=field):
        setattr(SamplingParams(), *next(iter(kwargs.items())))


def test_logit_bias_key_outside_the_vocab_is_refused_for_the_model():
    check_for_model(SamplingParams(logit_bias={VOCAB - 1: 1.0}), VOCAB)
    with pytest.raises(SamplingParamsError, match=r"logit_bias keys \[50\]") as e:
        check_for_model(SamplingParams(logit_bias={VOCAB: 1.0}), VOCAB)
    assert e.value.param == "logit_bias"
