"""Speculative decoding (n-gram drafts) on Qwen3.5, a hybrid model, through ``LLM``: greedy
output equals speculation off token for token and logprob for logprob (fp32, 1e-5) for a
batch of text prompts (then prompts that reach into their outputs, served by prefix-cache
state snapshots), a batch of image prompts, a stop token on the first token of an accepted run,
``max_tokens`` at a run's end, and under preemption; drafts were both accepted and rejected
(the request's ``spec_decode`` stats), so the recurrent state was rolled back
(``StateCache.accept_rows``); every block and state slot comes back.

The tiny random Qwen3.5 here has its token mixers' and MLPs' output projections scaled down
(``copy_prone``): its greedy walk then follows mostly the last token, so prompts that hold
its own earlier output make n-gram drafts that are often, not always, accepted; the layers
still move the logits far past the tolerance (a broken rollback fails these tests)."""

from __future__ import annotations

import random

import pytest
from safetensors.torch import load_file, save_file

from atlas_vlm import LLM, RequestOutputKind, SamplingParams
from helpers import IMAGES, conv
from qwen3_5_helpers import VOCAB, build_tiny_qwen3_5, tiny_vl_config

LOGPROB_ATOL, OUTPUT_SCALE = 1e-5, 0.02
BASE = dict(device="cpu", dtype="float32", max_model_len=512, kvcache_block_size=4, max_num_seqs=4,
            kv_cache_memory=1 << 22, hybrid_snapshot_interval=8)


def copy_prone(folder, scale: float = OUTPUT_SCALE) -> None:
    """Scale the decoder's ``out_proj`` / ``o_proj`` / ``down_proj`` weights by ``scale`` in place."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in tensors:
        if "visual" not in name and name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * scale
    save_file(tensors, str(path), metadata={"format": "pt"})


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, **kw)


def spec_llm(folder, k: int = 3, **kw) -> LLM:
    return LLM(str(folder), speculative="ngram", num_speculative_tokens=k, speculative_disable_by_batch_size=None,
               **{**BASE, **kw})


def assert_same(ref, out) -> None:
    assert out.token_ids == ref.token_ids
    assert (out.finish_reason, out.stop_reason) == (ref.finish_reason, ref.stop_reason)
    assert len(out.logprobs) == len(ref.logprobs)
    for a, b, ta, tb in zip(out.logprobs, ref.logprobs, out.top_logprobs, ref.top_logprobs):
        assert a == pytest.approx(b, abs=LOGPROB_ATOL)
        assert ta.keys() == tb.keys() and all(ta[t] == pytest.approx(tb[t], abs=LOGPROB_ATOL) for t in ta)


def assert_accepted_and_rejected(outs) -> None:
    accepted = sum(o.spec_decode["accepted"] for o in outs)
    proposed = sum(o.spec_decode["proposed"] for o in outs)
    assert accepted > 0, "no draft accepted: the state's rollback after acceptance is not covered"
    assert proposed > accepted, "no draft rejected: the state's rollback over rejected drafts is not covered"


def assert_everything_back(llm) -> None:
    bm, state = llm.engine.block_manager, llm.engine.runner.state_cache
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert state.num_free_slots == state.num_slots and state._rows == {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35_spec") / "text"
    build_tiny_qwen3_5(folder, text_only=True)
    copy_prone(folder)
    return folder


@pytest.fixture(scope="module")
def plain(folder):
    return LLM(str(folder), **BASE)


@pytest.fixture(scope="module")
def prompts(plain):
    """The model's own greedy output ``O``, then random tokens, then ``O``'s first tokens: its
    continuation walks ``O`` again (drafts found in the prompt), with detours (drafts rejected)."""
    rng = random.Random(0)
    seed = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(5)]}]
    walk = plain.generate(seed, greedy(24), use_tqdm=False)[0].token_ids
    return [{"prompt_token_ids": walk + [rng.randrange(VOCAB) for _ in range(n)] + walk[:2]} for n in (3, 8, 13)] + \
        [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(11)]}]


pytestmark = pytest.mark.text


@pytest.mark.parametrize("k", [2, 4])
def test_batch_equals_speculation_off(folder, plain, prompts, k):
    lens = [40, 31, 36, 20]
    params = [greedy(n) for n in lens]
    ref = plain.generate(prompts, params, use_tqdm=False)
    llm = spec_llm(folder, k)
    out = llm.generate(prompts, params, use_tqdm=False)
    for r, o, n in zip(ref, out, lens):
        assert_same(r, o)
        assert len(o.token_ids) == n
    assert_accepted_and_rejected(out)
    assert_everything_back(llm)
    # prompts that reach into the outputs: their hits end at a snapshot, none of them taken by a
    # verification step (its rows may be rejected; decodes never snapshot)
    longer = [{"prompt_token_ids": p["prompt_token_ids"] + o.token_ids[:n // 2]} for p, o, n in zip(prompts, out, lens)]
    want = plain.generate(longer, greedy(12), use_tqdm=False)
    hits = llm.engine.block_manager.state_snapshots.hits
    again = llm.generate(longer, greedy(12), use_tqdm=False)
    assert llm.engine.block_manager.state_snapshots.hits > hits
    for w, o in zip(want, again):
        assert_same(w, o)


def test_stop_token_on_the_first_token_of_an_accepted_run_and_max_tokens(folder, plain, prompts):
    llm = spec_llm(folder, 4)
    for prompt in prompts:  # the first prompt with an accepted run whose first token is new in the output
        steps = [o.new_token_ids for o in llm.generate(prompt, greedy(40, output_kind=RequestOutputKind.DELTA),
                                                       stream=True)]
        ids = sum(steps, [])
        first = [sum(map(len, steps[:i])) for i, s in enumerate(steps) if len(s) >= 2]  # runs' first tokens
        j = next((j for j in first if ids[j] not in ids[:j]), None)
        if j is not None:
            break
    assert j is not None, "no accepted run starts with a new token: the test covers no stop inside a run"
    params = [greedy(40, stop_token_ids=[ids[j]]), greedy(j + 1), greedy(first[-1] + 1)]
    want = plain.generate([prompt] * 3, params, use_tqdm=False)
    got = llm.generate([prompt] * 3, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert_same(w, g)
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) == j + 1
    assert_everything_back(llm)


def test_preemption(folder, plain, prompts):
    batch = [prompts[0], prompts[1], prompts[0], prompts[2]]
    ref = plain.generate(batch, greedy(40), use_tqdm=False)
    llm = spec_llm(folder, 3, num_kvcache_blocks=44, enable_prefix_caching=False)
    out = llm.generate(batch, greedy(40), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the block budget did not force a preemption"
    for r, o in zip(ref, out):
        assert_same(r, o)
    assert_accepted_and_rejected(out)
    assert_everything_back(llm)


@pytest.mark.vlm
def test_image_prompt_equals_speculation_off(tmp_path):
    folder = tmp_path / "vlm"
    build_tiny_qwen3_5(folder, seed=4, config=tiny_vl_config())
    copy_prone(folder)
    bounds = {"min_pixels": 16 * 32 * 32, "max_pixels": 40 * 32 * 32}
    kw = dict(BASE, max_model_len=1024, kvcache_block_size=16, hybrid_snapshot_interval=32)
    plain = LLM(str(folder), **kw)
    first = plain.generate({"messages": conv(IMAGES / "chelsea.png", text="Describe it."), "mm_options": bounds},
                           greedy(24), use_tqdm=False)[0]
    # its own answer in the question (its walk is found there: drafts), then a copy with every fifth
    # token changed (the most recent match: drafts rejected there)
    changed = plain.tokenizer.decode([t if i % 5 != 3 else 1000 + i for i, t in enumerate(first.token_ids)])
    prompts = [{"messages": conv(IMAGES / "chelsea.png", text=f"Describe it. {text}"), "mm_options": bounds}
               for text in (first.text, f"{first.text} | {changed}")]
    ref = plain.generate(prompts, greedy(40), use_tqdm=False)
    llm = spec_llm(folder, 3, **{k: v for k, v in kw.items() if k not in BASE or kw[k] != BASE[k]})
    out = llm.generate(prompts, greedy(40), use_tqdm=False)
    for r, o in zip(ref, out):
        assert_same(r, o)
    assert_accepted_and_rejected(out)
    assert_everything_back(llm)
