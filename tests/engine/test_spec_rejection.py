"""Speculative sampling with point-mass drafts (``spec_decode.rejection``): on a fixed
synthetic 5-token setup the emitted tokens follow the target's distribution (chi-square,
fixed seeds), a wrong rule is caught by the same check, and sampled requests with drafts run
in the engine (seeded: reproducible; every block back)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.spec_decode.rejection import rejection_sample

pytestmark = pytest.mark.text
TRIALS = 20000
CHI2_CRIT_DF4 = 18.47  # chi-square 0.999 quantile, 4 degrees of freedom (5 tokens)
P = torch.tensor([[0.10, 0.40, 0.05, 0.25, 0.20],  # row 0: after the last sampled token
                  [0.30, 0.10, 0.20, 0.15, 0.25],  # row 1: after draft 1
                  [0.05, 0.05, 0.60, 0.10, 0.20]])  # row 2: after draft 2 (the bonus row)
DRAFTS = [3, 2]


def chi2(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    return sum((counts.get(t, 0) - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs))


def run(sampler):
    g = torch.Generator().manual_seed(1234)
    first, second, third = Counter(), Counter(), Counter()
    for _ in range(TRIALS):
        tokens = sampler(P, DRAFTS, g)
        first[tokens[0]] += 1
        if tokens[0] == DRAFTS[0]:  # row 1 is emitted only after draft 1 was accepted
            second[tokens[1]] += 1
            if tokens[1] == DRAFTS[1]:
                third[tokens[2]] += 1
    return first, second, third


def test_emitted_tokens_follow_the_target_distribution_at_every_row():
    first, second, third = run(rejection_sample)
    assert chi2(first, P[0]) < CHI2_CRIT_DF4
    assert chi2(second, P[1]) < CHI2_CRIT_DF4
    assert chi2(third, P[2]) < CHI2_CRIT_DF4
    assert sum(second.values()) > 0.2 * TRIALS and sum(third.values()) > 0.03 * TRIALS  # enough samples


def test_the_check_catches_a_wrong_rule():
    def always_accept(probs, drafts, g):  # the draft every time: not the target's distribution
        return list(drafts) + [int(torch.multinomial(probs[len(drafts)], 1, generator=g))]

    def reject_to_p(probs, drafts, g):  # on reject draws from p itself (x not removed): biased to x
        out = []
        for j, x in enumerate(drafts):
            if bool(torch.rand((), generator=g) < probs[j, x]):
                out.append(x)
                continue
            return out + [int(torch.multinomial(probs[j], 1, generator=g))] * (len(drafts) + 1 - j)
        return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=g))]

    assert chi2(run(always_accept)[0], P[0]) > CHI2_CRIT_DF4
    assert chi2(run(reject_to_p)[0], P[0]) > CHI2_CRIT_DF4


def test_rejected_row_never_emits_its_draft_and_certain_draft_is_accepted():
    g = torch.Generator().manual_seed(0)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    assert rejection_sample(certain, [1], g)[0] == 1
    never = torch.tensor([[0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    for _ in range(50):
        tokens = rejection_sample(never, [1], g)
        assert tokens[0] != 1 and tokens[1] == tokens[0]


def test_sampled_requests_with_drafts_run_seeded_and_give_every_block_back(tiny_models):
    folder = tiny_models["qwen2"][0]
    kw = dict(max_model_len=512, kvcache_block_size=4, num_kvcache_blocks=256, device="cpu", dtype="float32")
    prompts = ["a b c d a b c d a b c d a b c", "x y x y x y x y x y"]
    params = [SamplingParams(temperature=0.3, top_k=5, seed=s, max_tokens=24, ignore_eos=True, logprobs=1)
              for s in (1, 2)]
    llm = LLM(str(folder), speculative="ngram", num_speculative_tokens=3, **kw)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 24 and len(a.logprobs) == 24
        assert a.spec_decode["proposed"] > 0
    assert sum(o.spec_decode["accepted"] for o in first) > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
