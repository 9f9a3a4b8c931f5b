"""Prefix caching of a hybrid model (a tiny random Qwen3.5 through ``LLM``, fp32): with state
snapshots every 16 tokens, cache on gives the same greedy tokens as cache off and logits within
1e-5, for a hit at a snapshot boundary, a shared prefix that ends between snapshots (the hit
falls back to the earlier one), a batch of hits, under preemption, and after the snapshot was
evicted with its block (a miss); and hits do happen (computed-from-cache tokens > 0, and the
snapshot hits / queries in the engine stats and /metrics)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.engine.async_llm import AsyncLLM
from atlas_vlm.entrypoints.openai.metrics import _EngineCollector
from atlas_vlm.engine.plan import KVBudgetError
from mm_kv_cache_management import RequestState
from qwen3_5_helpers import VOCAB, build_tiny_qwen3_5, record_cached_and_logits

pytestmark = pytest.mark.text
INTERVAL, MAX_TOKENS, LOGIT_ATOL = 16, 6, 1e-5
rng = random.Random(0)
PREFIX = [rng.randrange(VOCAB) for _ in range(32)]  # two snapshot intervals
A = PREFIX + [rng.randrange(VOCAB) for _ in range(9)]
B = PREFIX + [rng.randrange(VOCAB) for _ in range(5)]  # shares 32 tokens with A: a snapshot boundary
C = PREFIX[:28] + [rng.randrange(VOCAB) for _ in range(11)]  # shares 28: KV hits 28, the snapshot is at 16
D = PREFIX + [rng.randrange(VOCAB) for _ in range(13)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35_prefix") / "text"
    build_tiny_qwen3_5(folder, text_only=True)
    return folder


def make_llm(folder, **kwargs):
    base = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=4, max_num_seqs=4,
                kv_cache_memory=1 << 21, max_num_batched_tokens=24, hybrid_snapshot_interval=INTERVAL,
                max_state_snapshots=8)
    return record_cached_and_logits(LLM(str(folder), **{**base, **kwargs}))


def generate(llm, prompts):
    """``[(tokens, logits [MAX_TOKENS, vocab], cached tokens)]``, all prompts in one batch."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.token_ids, torch.stack(llm.seen[o.request_id][1]), llm.seen[o.request_id][0]) for o in outs]


@pytest.fixture(scope="module")
def reference(folder):
    """Cache off, each prompt alone: ``tuple(prompt) -> (tokens, logits)``."""
    llm = make_llm(folder, enable_prefix_caching=False)
    assert llm.engine.block_manager.state_snapshots is None and llm.engine.runner.state_snapshots is None
    return {tuple(p): generate(llm, [p])[0][:2] for p in (A, B, C, D)}


def assert_exact(reference, prompts, results):
    for p, (tokens, logits, _) in zip(prompts, results):
        ref_tokens, ref_logits = reference[tuple(p)]
        assert tokens == ref_tokens
        assert (logits - ref_logits).abs().max().item() < LOGIT_ATOL


def assert_snapshots_have_their_blocks(llm):
    bm = llm.engine.block_manager
    assert all(h in bm._cached for h in bm.state_snapshots._valid)


def test_hits_at_and_between_snapshots_are_exact(folder, reference):
    llm = make_llm(folder)
    results = [generate(llm, [p])[0] for p in (A, B, C)]
    assert_exact(reference, (A, B, C), results)
    assert [cached for *_, cached in results] == [0, 32, 16]  # at 32; C's 28-token KV hit falls back to 16
    pool = llm.engine.block_manager.state_snapshots
    assert (pool.hits, pool.queries) == (2, 3)
    assert_snapshots_have_their_blocks(llm)
    front = SimpleNamespace(engine=llm.engine, stat_logger=None)  # what AsyncLLM snapshots after a step
    AsyncLLM._snapshot(front, 0)
    metrics = {m.name: m.samples[0].value for m in _EngineCollector(front).collect()}
    assert (metrics["atlas:state_snapshot_hits"], metrics["atlas:state_snapshot_queries"]) == (2, 3)


def test_a_batch_of_hits_is_exact(folder, reference):
    llm = make_llm(folder)
    generate(llm, [A])
    results = generate(llm, [B, C, D])
    assert_exact(reference, (B, C, D), results)
    assert [cached for *_, cached in results] == [32, 16, 32]


def test_preemption_is_exact(folder, reference):
    llm = make_llm(folder, num_kvcache_blocks=13)  # A (11 blocks) and B (2 past its hit): no room to decode
    results = generate(llm, [A, B, C, D])
    assert_exact(reference, (A, B, C, D), results)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.state_cache.num_free_slots == 4
    assert_snapshots_have_their_blocks(llm)


def test_a_snapshot_evicted_with_its_block_is_a_miss(folder, reference):
    llm = make_llm(folder, num_kvcache_blocks=16)
    generate(llm, [A])
    pool = llm.engine.block_manager.state_snapshots
    hashes = RequestState("a", A).block_hashes(4)
    assert len(pool) == 2 and hashes[3] in pool and hashes[7] in pool  # at 16 and 32
    other = [random.Random(1).randrange(VOCAB) for _ in range(58)]  # 64 tokens with its output: all of A evicted
    generate(llm, [other])
    assert_snapshots_have_their_blocks(llm)
    assert hashes[3] not in pool and hashes[7] not in pool  # A's snapshots at 16 and 32 went with their blocks
    (result,) = generate(llm, [B])
    assert result[2] == 0  # the miss: computed from token 0
    assert_exact(reference, [B], [result])


def test_serve_flags_and_config_checks():
    from atlas_vlm import EngineConfig
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    parse = cli.build_parser().parse_args
    config = engine_config_from_args(parse(["serve", "m", "--max-state-snapshots", "3",
                                            "--hybrid-snapshot-interval", "64"]))
    assert (config.max_state_snapshots, config.hybrid_snapshot_interval) == (3, 64)
    config = engine_config_from_args(parse(["serve", "m"]))
    assert (config.max_state_snapshots, config.hybrid_snapshot_interval) == (16, 256)  # EngineConfig's defaults
    with pytest.raises(ValueError, match="max_state_snapshots must be >= 0"):
        EngineConfig(model="m", max_state_snapshots=-1)
    with pytest.raises(ValueError, match="hybrid_snapshot_interval must be >= 1"):
        EngineConfig(model="m", hybrid_snapshot_interval=0)


def test_an_interval_off_the_block_size_or_a_pool_over_the_budget_is_refused_and_zero_turns_caching_off(folder):
    with pytest.raises(ValueError, match="hybrid_snapshot_interval must be a positive multiple of the block size"):
        make_llm(folder, hybrid_snapshot_interval=18)
    llm = make_llm(folder, max_state_snapshots=0)
    assert not llm.engine.block_manager.enable_prefix_caching and llm.engine.runner.state_snapshots is None
    per_seq = llm.engine.runner.state_cache.spec.bytes_per_seq
    with pytest.raises(KVBudgetError, match=rf"max_num_seqs=4 \+ max_state_snapshots=8 x {per_seq} bytes"):
        make_llm(folder, kv_cache_memory=11 * per_seq)  # the slots fit, the snapshot pool does not


def test_reset_empties_the_snapshot_pool(folder):
    llm = make_llm(folder)
    generate(llm, [A])
    pool = llm.engine.block_manager.state_snapshots
    assert len(pool) == 2
    llm.engine.reset()
    assert llm.engine.block_manager.state_snapshots is pool and len(pool) == 0
    (result,) = generate(llm, [B])
    assert result[2] == 0
