"""The Triton paged-attention kernel and KV write against their PyTorch references
(``layers.attention``'s ``"reference"`` backend, ``PagedKVCache.write``): hypothesis over
block tables (random block ids), cached-prefix + new-token splits (prefill, chunked prefill
and decode rows in one step), GQA ratios, head sizes 64 / 80 / 96 / 128 and dtypes; fp32
to 1e-5, fp16 / bf16 against an fp32 reference on the same rounded inputs. Small shapes and
few examples: on CPU the interpreter runs every program in numpy."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from atlas_vlm.kernels.triton_attention import build_triton_layout, unified_attention
from atlas_vlm.kernels.triton_cache import reshape_and_cache
from atlas_vlm.layers.attention import build_attention_metadata, paged_attention
from mm_kv_cache_management import ContiguousKVCache, KVCacheSpec, PagedKVCache

pytestmark = [pytest.mark.text, pytest.mark.triton]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ATOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
FEW = settings(max_examples=20, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def random_step(rng: random.Random, splits: list[tuple[int, int]], block_size: int, num_blocks: int):
    """(query_lens, context_lens, slot_mapping, block_tables) for (cached prefix, new tokens)
    per request, blocks drawn at random from ``num_blocks``."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    q_lens, c_lens, slots, tables = [], [], [], []
    for prefix, new in splits:
        c = prefix + new
        table = [free.pop() for _ in range(-(-c // block_size))]
        q_lens.append(new)
        c_lens.append(c)
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(prefix, c)]
    return q_lens, c_lens, slots, tables


def filled_cache(kv_heads: int, head_dim: int, dtype: torch.dtype, num_blocks: int, block_size: int,
                 seed: int) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, dtype), num_blocks, block_size, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=g))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=g))
    return cache


def fp32_reference(q, cache: PagedKVCache, meta_args) -> torch.Tensor:
    """The reference backend in fp32 over the cache's (already rounded) values."""
    ref = PagedKVCache(KVCacheSpec(1, cache.spec.num_kv_heads, cache.spec.head_dim, torch.float32),
                       cache.num_blocks, cache.block_size, device=DEVICE)
    ref.k_cache.copy_(cache.k_cache)
    ref.v_cache.copy_(cache.v_cache)
    meta = build_attention_metadata(*meta_args, device=DEVICE, backend="reference")
    return paged_attention(q.float(), None, None, ref, 0, meta, q.shape[-1] ** -0.5)


splits = st.lists(st.tuples(st.integers(0, 20), st.integers(1, 10)), min_size=1, max_size=3)


@FEW
@given(splits=splits, head_dim=st.sampled_from([64, 80, 96, 128]), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3, 4]), dtype=st.sampled_from(list(DTYPES)), block_size=st.sampled_from([4, 16]),
       seed=st.integers(0, 2 ** 16))
def test_unified_attention_matches_the_reference(splits, head_dim, kv_heads, group, dtype, block_size, seed):
    dtype, num_blocks = DTYPES[dtype], 24
    args = random_step(random.Random(seed), splits, block_size, num_blocks)
    cache = filled_cache(kv_heads, head_dim, dtype, num_blocks, block_size, seed)
    q = torch.randn(sum(args[0]), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed))
    q = q.to(dtype).to(DEVICE)
    tables = build_attention_metadata(*args, device=DEVICE, backend="reference").block_tables
    out = unified_attention(q, cache.k_cache[0], cache.v_cache[0], build_triton_layout(args[0], args[1], tables),
                            head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), fp32_reference(q, cache, args), atol=ATOL[dtype], rtol=0)


@FEW
@given(num_tokens=st.integers(1, 12), kv_heads=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([64, 80, 96]),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2 ** 16))
def test_reshape_and_cache_writes_what_the_cache_writes(num_tokens, kv_heads, head_dim, dtype, seed):
    dtype, block_size, num_blocks = DTYPES[dtype], 4, 8
    ours = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, dtype), num_blocks, block_size, device=DEVICE)
    ref = copy.deepcopy(ours)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    k, v = torch.randn(2, num_tokens, kv_heads, head_dim, generator=g).to(DEVICE)  # fp32: the kernel casts
    reshape_and_cache(k, v, ours.k_cache[0], ours.v_cache[0], slots)
    ref.write(0, slots, k, v)
    assert torch.equal(ours.k_cache, ref.k_cache) and torch.equal(ours.v_cache, ref.v_cache)


def test_negative_slots_write_nothing():
    cache = PagedKVCache(KVCacheSpec(1, 2, 64, torch.float32), 2, 4, device=DEVICE)
    k = torch.ones(2, 2, 64, device=DEVICE)
    reshape_and_cache(k, k, cache.k_cache[0], cache.v_cache[0], torch.tensor([-1, 5], device=DEVICE))
    assert cache.k_cache[0].view(-1, 2, 64).sum(dim=(1, 2)).tolist() == [0.0] * 5 + [128.0] + [0.0] * 2


@pytest.mark.parametrize("kind", ["paged", "contiguous", "none"])
def test_triton_backend_through_paged_attention(kind):
    """The backend as layers call it: new K/V written by the kernel, then attended; a mixed
    step (decode row, chunk over a prefix, fresh prefill) on either cache, or no cache."""
    heads, kv_heads, head_dim, bs = 4, 2, 80, 4
    args = random_step(random.Random(0), [(9, 1), (6, 5), (0, 7)], bs, 12)
    if kind == "none":
        args = random_step(random.Random(0), [(0, 3), (0, 8)], bs, 12)
    q_lens, c_lens, slots, tables = args
    spec = KVCacheSpec(1, kv_heads, head_dim, torch.float32)
    cache = None if kind == "none" else PagedKVCache(spec, 12, bs, device=DEVICE)
    if kind == "contiguous":
        cache, tables = ContiguousKVCache(spec, 3, 16, device=DEVICE), [[2], [0], [1]]
        slots = [t[0] * 16 + p for t, q, c in zip(tables, q_lens, c_lens) for p in range(c - q, c)]
    if cache is not None:
        cache.k_cache.normal_()
        cache.v_cache.normal_()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(DEVICE)
    k, v = torch.randn(2, sum(q_lens), kv_heads, head_dim, generator=g).to(DEVICE)
    results = {}
    for backend in ("reference", "triton"):
        c = copy.deepcopy(cache)
        meta = build_attention_metadata(q_lens, c_lens, slots, tables, device=DEVICE, backend=backend)
        results[backend] = paged_attention(q, k, v, c, 0, meta, head_dim ** -0.5), c
    (ref, ref_cache), (ours, our_cache) = results["reference"], results["triton"]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    if cache is not None:
        assert torch.equal(our_cache.k_cache, ref_cache.k_cache) and torch.equal(our_cache.v_cache, ref_cache.v_cache)
