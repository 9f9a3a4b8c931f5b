"""The n-gram (prompt-lookup) draft proposer: longest suffix first, most recent match first,
never inside or into a media placeholder run, never a placeholder id."""

from __future__ import annotations

import random

import pytest

from atlas_vlm.spec_decode import NgramProposer
from mm_kv_cache_management import PlaceholderRange

pytestmark = pytest.mark.text
PAD = 900


def brute_force(tokens, k, max_n, min_n, masked):
    """The rule spelled out with plain loops (the reference for the numpy version)."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        if any(masked[num - n:]):
            continue
        for s in range(num - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[num - n:] and not any(masked[s:s + n]):
                out = []
                for j in range(s + n, min(s + n + k, num)):
                    if masked[j]:
                        break
                    out.append(tokens[j])
                if out:
                    return out
    return []


def test_longest_suffix_wins_over_more_recent_shorter_match():
    # "1 2 3" occurred at the start followed by 4 5; "3" alone occurred later followed by 9
    tokens = [1, 2, 3, 4, 5, 3, 9, 7, 1, 2, 3]
    assert NgramProposer(max_n=3, min_n=1).propose(tokens, 2) == [4, 5]
    assert NgramProposer(max_n=1, min_n=1).propose(tokens, 2) == [9, 7]


def test_most_recent_match_first_and_k_caps():
    tokens = [5, 6, 1, 5, 7, 2, 5]
    assert NgramProposer(max_n=2, min_n=1).propose(tokens, 1) == [7]
    assert NgramProposer(max_n=2, min_n=1).propose(tokens, 5) == [7, 2, 5]  # up to the end
    assert NgramProposer().propose(tokens, 0) == []


def test_no_match_no_drafts():
    assert NgramProposer(max_n=4, min_n=2).propose([1, 2, 3, 4, 5], 3) == []
    assert NgramProposer().propose([7], 3) == []


def test_media_run_is_neither_matched_nor_proposed():
    # tokens 2..5 are an image's placeholder run; "8" follows it, and "8" ends the tokens
    tokens = [8, 1, PAD, PAD, PAD, PAD, 8, 3, 4, 8]
    run = [PlaceholderRange(offset=2, length=4, content_hash="x")]
    p = NgramProposer(max_n=2, min_n=1, placeholder_token_ids=[PAD])
    assert p.propose(tokens, 3, run) == [3, 4, 8]  # most recent "8" is at 6
    # a continuation stops before the run: "1" is followed by the image
    assert p.propose([1, PAD, PAD, 7, 1], 3, [PlaceholderRange(1, 2, "y")]) == []
    # a suffix ending in pads is never looked up
    assert p.propose([PAD, PAD, 1, PAD, PAD], 3, []) == []


def test_placeholder_id_outside_a_run_is_never_proposed():
    p = NgramProposer(max_n=1, min_n=1, placeholder_token_ids=[PAD])
    assert p.propose([4, 6, PAD, 2, 4], 3) == [6]


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_on_random_tokens(seed):
    rng = random.Random(seed)
    for _ in range(150):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        runs, masked = [], [False] * len(tokens)
        if len(tokens) > 6 and rng.random() < 0.5:
            off = rng.randrange(len(tokens) - 3)
            runs.append(PlaceholderRange(off, 3, "h"))
            masked[off:off + 3] = [True] * 3
        masked = [m or t == 4 for m, t in zip(masked, tokens)]  # token 4 plays the placeholder id
        max_n, k = rng.randrange(1, 5), rng.randrange(1, 6)
        got = NgramProposer(max_n=max_n, min_n=1, placeholder_token_ids=[4]).propose(tokens, k, runs)
        assert got == brute_force(tokens, k, max_n, 1, masked), (tokens, runs, max_n, k)


@pytest.mark.parametrize("kwargs, field", [(dict(min_n=0), "min_n"), (dict(max_n=1, min_n=2), "max_n"),
                                           (dict(min_n=True), "min_n")])
def test_bad_settings_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)


def test_a_request_whose_drafts_keep_failing_drafts_only_to_probe():
    from types import SimpleNamespace

    from atlas_vlm.spec_decode.scheduling import ACCEPTANCE_FLOOR, PROBE_EVERY, draft_limit, take_verified

    req = SimpleNamespace(spec_acceptance=1.0, num_output_tokens=3, max_tokens=100, num_tokens=50,
                          spec_token_ids=[7, 8, 9, 10], token_ids=list(range(46)) + [7, 8, 9, 10],
                          spec_decode={"drafts": 0, "proposed": 0, "accepted": 0})
    assert draft_limit(req, 4, 100, None) == 4
    scheduler = SimpleNamespace(spec_decode_stats={"drafts": 0, "proposed": 0, "accepted": 0})
    sampled = SimpleNamespace(errors=[None] * 5, token_ids=[1, 2, 3, 4, 5])  # the first draft is rejected
    for _ in range(4):  # four steps with every draft rejected
        req.spec_token_ids, req.token_ids = [7, 8, 9, 10], req.token_ids[:46] + [7, 8, 9, 10]
        assert take_verified(scheduler, req, sampled, 0) == [0]
    assert req.spec_acceptance == pytest.approx(0.7 ** 4) and req.spec_acceptance < ACCEPTANCE_FLOOR
    assert draft_limit(req, 4, 100, None) == 0  # 3 output tokens: not a probe step
    req.num_output_tokens = PROBE_EVERY
    assert draft_limit(req, 4, 100, None) == 1  # a probe
    sampled.token_ids = [7, 5, 3, 4, 5]  # the probe's draft is accepted: the average climbs again
    req.spec_token_ids, req.token_ids = [7], req.token_ids[:46] + [7]
    assert take_verified(scheduler, req, sampled, 0) == [0, 1]
    assert req.spec_acceptance == pytest.approx(0.7 ** 5 + 0.3)
    assert req.spec_decode == {"drafts": 5, "proposed": 17, "accepted": 1}
