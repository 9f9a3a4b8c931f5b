"""Stage 2: the contiguous KV cache. After every decode step, the logits equal a cache-free
full re-prefill of the whole sequence so far (atol 1e-5), for Qwen2 and Llama."""

from __future__ import annotations

import pytest
import torch

from helpers import StepRecorder
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers.attention import build_attention_metadata

pytestmark = pytest.mark.text

FAMILIES = ("qwen2", "llama")
MAX_MODEL_LEN = 128


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 150000, (n,), generator=g).tolist()


@torch.no_grad()
def no_cache_last_logits(model, ids: list[int]) -> torch.Tensor:
    """Last-token logits of one cache-free full prefill of ``ids``."""
    n = len(ids)
    meta = build_attention_metadata([n], [n], list(range(n)), [[0]])
    hidden = model(model.embed(torch.tensor(ids)), torch.arange(n), None, meta)
    return model.compute_logits(hidden[-1:])[0]


@pytest.fixture(scope="module")
def engines(tiny_models):
    return {fam: LLM(str(tiny_models[fam][0]), kv_cache="contiguous", max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=3,
                     dtype="float32")
            for fam in FAMILIES}


def test_contiguous_layout(engines):
    llm = engines["qwen2"]
    cache = llm.engine.runner.kv_cache
    assert type(cache).__name__ == "ContiguousKVCache"
    assert llm.engine.block_manager.block_size == MAX_MODEL_LEN  # one strip per request
    assert tuple(cache.k_cache.shape) == (2, 3, MAX_MODEL_LEN, 2, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_32_decode_steps_equal_full_reprefill(family, engines):
    llm = engines[family]
    ids = prompt(20, seed=11)
    with StepRecorder(llm) as rec:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=33, ignore_eos=True), use_tqdm=False)[0]
    steps = rec.logits[out.request_id]
    assert len(steps) == len(out.token_ids) == 33  # 1 prefill + 32 decode steps
    model = llm.engine.runner.model
    seq = list(ids)
    for step, (logits, token) in enumerate(zip(steps, out.token_ids)):
        ref = no_cache_last_logits(model, seq)
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0, msg=lambda m: f"step {step}: {m}")
        assert token == int(logits.argmax())
        seq.append(token)
    assert out.finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_two_strips_at_once_equal_full_reprefill(family, engines):
    """Two requests share the contiguous cache (one strip each): each one's every step
    still equals its own cache-free re-prefill, and each holds exactly one strip."""
    llm = engines[family]
    prompts = [prompt(5, seed=12), prompt(41, seed=13)]
    runner = llm.engine.runner
    with StepRecorder(llm) as rec:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    model = runner.model
    seen = []
    for p, out in zip(prompts, outs):
        (table,) = {t for _, _, t in rec.chunks[out.request_id]}  # the same single strip at every step
        assert len(table) == 1
        seen.append(table[0])
        seq = list(p)
        logits = rec.logits[out.request_id]
        assert len(logits) == 12
        for step, (row, token) in enumerate(zip(logits, out.token_ids)):
            torch.testing.assert_close(row, no_cache_last_logits(model, seq), atol=1e-5, rtol=0,
                                       msg=lambda m: f"step {step}: {m}")
            seq.append(token)
    assert seen[0] != seen[1]
    assert llm.engine.block_manager.num_free_blocks == 3
