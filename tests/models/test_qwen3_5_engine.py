"""A tiny random Qwen3.5 (hybrid: Gated DeltaNet + full attention) through ``LLM``: a batch of
three token prompts of different lengths gives HF ``generate``'s greedy tokens and logprobs,
with chunked prefill and under preemption, every state slot back at the end; the planner's
bytes equal what the engine allocates, and the model's StateSpec equals the planner's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.memory_plan import plan
from mm_kv_cache_management import state_spec_from_config
from qwen3_5_helpers import build_tiny_qwen3_5

pytestmark = pytest.mark.text
PROMPTS = [[5, 17, 42], list(range(30, 52)), [7, 8, 9, 10, 11, 12, 13, 14, 15]]
MAX_TOKENS = 10
MAX_SEQS = 4


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35_engine") / "vlm"
    return folder, build_tiny_qwen3_5(folder)


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(out.logits, tokens)]
    return tokens, logprobs


def make_llm(folder, **kwargs):
    base = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=4, max_num_seqs=MAX_SEQS,
                kv_cache_memory=1 << 20, max_num_batched_tokens=8)
    return LLM(str(folder), **{**base, **kwargs})


@pytest.mark.parametrize("options", [{}, dict(num_kvcache_blocks=8)], ids=["chunked_prefill", "preemption"])
def test_batch_equals_hf_generate(vlm_checkpoint, options):
    folder, hf = vlm_checkpoint
    llm = make_llm(folder, **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = hf_greedy(hf, prompt)
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert (llm.engine.scheduler.num_preemptions > 0) == ("num_kvcache_blocks" in options)
    assert llm.engine.runner.state_cache.num_free_slots == MAX_SEQS


def test_planner_bytes_equal_the_engine_and_the_model_spec(tmp_path):
    folder = tmp_path / "text"
    build_tiny_qwen3_5(folder, text_only=True)  # the composite config's vision tower has no count in plan yet
    budget = 1 << 20
    llm = make_llm(folder, kv_cache_memory=budget)
    runner = llm.engine.runner
    config = AutoConfig.from_pretrained(folder)
    assert runner.model.state_spec() == state_spec_from_config(config) == runner.state_cache.spec
    p = plan(config, dtype="fp32", block_size=4, max_num_seqs=MAX_SEQS)
    assert p.state_bytes == runner.state_cache.conv.nbytes + runner.state_cache.recurrent.nbytes
    assert p.kv_bytes_per_token == runner.kv_cache.spec.bytes_per_token == 2 * 1 * 2 * 32 * 4  # 1 of 4 layers
    pool = runner.state_snapshots  # prefix caching on: the snapshot pool, off the budget with the slots
    assert p.snapshot_bytes == pool.nbytes == 16 * p.state_bytes_per_seq
    assert runner.num_blocks == (budget - p.state_bytes - p.snapshot_bytes) // p.kv_bytes_per_block
    off = plan(config, dtype="fp32", block_size=4, max_num_seqs=MAX_SEQS, max_state_snapshots=0)
    runner = make_llm(folder, kv_cache_memory=budget, max_state_snapshots=0).engine.runner  # no pool, no prefix cache
    assert off.snapshot_bytes == 0 and runner.state_snapshots is None
    assert runner.num_blocks == (budget - off.state_bytes) // off.kv_bytes_per_block
