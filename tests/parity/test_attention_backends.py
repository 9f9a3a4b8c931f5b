"""The ``"bucketed"`` attention backend against the ``"reference"`` one: the same
``paged_attention`` call on random block tables, mixed context lengths, GQA and mixed
prefill + decode steps agrees within 1e-5 in fp32 (and writes the same cache); its decode
buckets bound padding as documented; and an engine greedy-decodes the same tokens with either
backend."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from helpers import CPU_FP32
from atlas_vlm import LLM, EngineConfig, SamplingParams
from atlas_vlm.layers.attention import build_attention_metadata, paged_attention, resolve_attention_backend
from atlas_vlm.layers.attention_bucketed import BUCKET_RATIO, BUCKET_SLACK, decode_groups
from mm_kv_cache_management import ContiguousKVCache, KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.text

HEADS, KV_HEADS, HEAD_DIM, BS, NUM_BLOCKS = 8, 2, 16, 16, 640  # 32 requests x <= 19 blocks fit


def random_step(rng: random.Random, num_seqs: int, decode_share: float, max_ctx: int = 300):
    """(query_lens, context_lens, slot_mapping, block_tables) with blocks drawn at random."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    q_lens, c_lens, slots, tables = [], [], [], []
    for _ in range(num_seqs):
        c = rng.randint(1, max_ctx)
        q = 1 if rng.random() < decode_share else rng.randint(1, c)
        table = [free.pop() for _ in range(-(-c // BS))]
        q_lens.append(q)
        c_lens.append(c)
        tables.append(table)
        slots += [table[p // BS] * BS + p % BS for p in range(c - q, c)]
    return q_lens, c_lens, slots, tables


def run_both(cache, q_lens, c_lens, slots, tables, seed: int, reference_cache=None,
             backends=("reference", "bucketed"), verify=None):
    """Outputs and caches of both backends on copies of ``cache`` (layer 1 of 2), in the
    cache's dtype; the reference runs on ``reference_cache`` (and q/k/v cast to its dtype)
    when given. ``verify``: ``build_attention_metadata``'s speculative verification flags."""
    g = torch.Generator().manual_seed(seed)
    n = sum(q_lens)
    kv_heads, dtype = (KV_HEADS, torch.float32) if cache is None else (cache.spec.num_kv_heads, cache.spec.dtype)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
    k, v = torch.randn(2, n, kv_heads, HEAD_DIM, generator=g).to(dtype)
    results = {}
    for backend in backends:
        c = copy.deepcopy(reference_cache if backend == "reference" and reference_cache is not None else cache)
        if c is not None:
            q, k, v = q.to(c.spec.dtype), k.to(c.spec.dtype), v.to(c.spec.dtype)
        meta = build_attention_metadata(q_lens, c_lens, slots, tables, backend=backend, verify=verify)
        results[backend] = (paged_attention(q, k, v, c, 1, meta, HEAD_DIM ** -0.5), c)
    return results


def filled_paged_cache(seed: int, dtype: torch.dtype = torch.float32, kv_heads: int = KV_HEADS) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(2, kv_heads, HEAD_DIM, dtype), NUM_BLOCKS, BS)
    g = torch.Generator().manual_seed(seed)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=g))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=g))
    return cache


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_seqs, decode_share", [(32, 1.0), (12, 0.7), (5, 0.0), (1, 1.0)])
def test_bucketed_equals_reference_on_random_steps(seed, num_seqs, decode_share):
    q_lens, c_lens, slots, tables = random_step(random.Random(seed), num_seqs, decode_share)
    results = run_both(filled_paged_cache(seed), q_lens, c_lens, slots, tables, seed)
    (ref, ref_cache), (ours, our_cache) = results["reference"], results["bucketed"]
    assert ours.shape == (sum(q_lens), HEADS, HEAD_DIM)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert torch.equal(our_cache.k_cache, ref_cache.k_cache) and torch.equal(our_cache.v_cache, ref_cache.v_cache)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])  # MQA, GQA (4 query heads per KV head), MHA
def test_bucketed_in_bf16_matches_the_fp32_reference(kv_heads):
    """bf16 decode folds each KV head's query heads into query rows (no ``enable_gqa``): the
    same values as the fp32 reference on the same bf16-representable inputs, within bf16's
    output rounding (2^-8 relative on values of magnitude ~1)."""
    q_lens, c_lens, slots, tables = random_step(random.Random(3), 24, 0.8)
    bf16 = filled_paged_cache(3, torch.bfloat16, kv_heads)
    fp32 = PagedKVCache(KVCacheSpec(2, kv_heads, HEAD_DIM, torch.float32), NUM_BLOCKS, BS)
    fp32.k_cache.copy_(bf16.k_cache)
    fp32.v_cache.copy_(bf16.v_cache)
    results = run_both(bf16, q_lens, c_lens, slots, tables, 3, reference_cache=fp32)
    (ref, _), (ours, _) = results["reference"], results["bucketed"]
    assert ours.dtype == torch.bfloat16 and ref.dtype == torch.float32
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=1e-2)
    assert (ours.float() - ref).abs().mean() < 2e-3


def test_bucketed_without_cache_is_a_full_prefill():
    q_lens = [7, 1, 30]
    results = run_both(None, q_lens, q_lens, list(range(38)), [[0], [1], [2, 3]], seed=3)
    torch.testing.assert_close(results["bucketed"][0], results["reference"][0], atol=1e-5, rtol=0)


def test_bucketed_on_the_contiguous_cache():
    cache = ContiguousKVCache(KVCacheSpec(2, KV_HEADS, HEAD_DIM, torch.float32), max_num_seqs=4, max_model_len=64)
    cache.k_cache.normal_(generator=torch.Generator().manual_seed(0))
    cache.v_cache.normal_(generator=torch.Generator().manual_seed(1))
    q_lens, c_lens, tables = [1, 5, 1], [40, 9, 64], [[2], [0], [3]]
    slots = [2 * 64 + 39] + [0 * 64 + p for p in range(4, 9)] + [3 * 64 + 63]
    results = run_both(cache, q_lens, c_lens, slots, tables, seed=4)
    torch.testing.assert_close(results["bucketed"][0], results["reference"][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_decode_buckets_bound_padding_and_cover_every_request(seed):
    rng = random.Random(seed)
    lens = [rng.randint(2, 4000) for _ in range(rng.randint(1, 64))]
    groups = decode_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        lo, hi = min(lens[i] for i in g), max(lens[i] for i in g)
        assert hi <= max(lo * BUCKET_RATIO, lo + BUCKET_SLACK)
    assert decode_groups([100] * 5) == [[0, 1, 2, 3, 4]]
    assert decode_groups([1000, 10, 3000]) == [[1], [0], [2]]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model="unused", attention_backend="flash")
    with pytest.raises(ValueError, match="attention backend must be 'auto' or one of"):
        resolve_attention_backend("flash", "cpu", torch.float32, 8, 2, 16)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        build_attention_metadata([1], [1], [0], [[0]], backend="flash")


def test_engine_greedy_tokens_identical_with_either_backend(tiny_models):
    """Mixed prompt lengths, chunked prefill next to decodes (24-token steps), both caches."""
    folder = str(tiny_models["qwen2"][0])
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(n)] for i, n in enumerate([3, 40, 17, 90, 1, 64, 33])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for kind in ("paged", "contiguous"):
        for backend in ("reference", "bucketed", "decode_kernel"):
            llm = LLM(folder, kv_cache=kind, max_model_len=256, num_kvcache_blocks=64 if kind == "paged" else 8,
                      max_num_batched_tokens=24, attention_backend=backend, **CPU_FP32)
            assert llm.engine.runner.attention_backend == backend
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[kind, backend] = [o.token_ids for o in outs]
            assert all(len(t) == 20 for t in tokens[kind, backend])
    assert len(set(map(str, tokens.values()))) == 1, tokens  # 6 runs, one answer


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """The per-row padded tables as the layout built them before ``block_table_tensor``."""
    width = max(len(t) for t in rows)
    return torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.long)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("backend", ["reference", "bucketed", "decode_kernel"])
def test_block_tables_built_once_equal_the_per_row_lists(seed, backend):
    # the step's [num_seqs, max_blocks] tensor is built once and every bucket / decode batch /
    # prefill chunk takes its rows: the same values as building each from the Python lists
    q_lens, c_lens, slots, tables = random_step(random.Random(seed), 24, 0.7)
    meta = build_attention_metadata(q_lens, c_lens, slots, tables, backend=backend)
    assert torch.equal(meta.block_tables, _padded(tables))
    if meta.bucketed is None:
        return
    decodes = [i for i, (q, c) in enumerate(zip(q_lens, c_lens)) if q == 1 and c > 1]
    if (d := meta.bucketed.decode_batch) is not None:
        assert d.block_tables.is_contiguous() and torch.equal(d.block_tables, _padded([tables[i] for i in decodes]))
    starts = torch.tensor([0] + q_lens[:-1]).cumsum(0).tolist()
    for b in meta.bucketed.decode_buckets:
        seqs = [starts.index(t) for t in b.token_index.tolist()]
        assert b.block_tables.is_contiguous() and torch.equal(b.block_tables, _padded([tables[s] for s in seqs]))
    for p in meta.bucketed.prefills:
        assert torch.equal(p.block_table, torch.tensor([tables[starts.index(p.start)]]))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_seqs, decode_share", [(12, 0.7), (5, 0.0)])
def test_batch_invariant_backend_equals_reference_on_random_steps(seed, num_seqs, decode_share):
    """``deterministic=True``'s layout (every query row through the C decode kernel,
    ``layers.batch_invariant.per_row_layout``): the reference's values within 1e-5 in fp32,
    on mixed prefill + decode steps, and the same cache writes."""
    from atlas_vlm.kernels import decode_kernel

    assert decode_kernel.available(), "the C decode kernel did not build here"
    q_lens, c_lens, slots, tables = random_step(random.Random(seed), num_seqs, decode_share)
    results = run_both(filled_paged_cache(seed), q_lens, c_lens, slots, tables, seed,
                       backends=("reference", "batch_invariant"))
    (ref, ref_cache), (ours, our_cache) = results["reference"], results["batch_invariant"]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert torch.equal(our_cache.k_cache, ref_cache.k_cache) and torch.equal(our_cache.v_cache, ref_cache.v_cache)
