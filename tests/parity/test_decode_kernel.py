"""The C decode kernel (``atlas_vlm.kernels.decode_kernel``, backend ``"decode_kernel"``)
against the reference backend: the same ``paged_attention`` call on random block tables,
decode-only and mixed with prefill chunks, MQA / GQA / MHA, block sizes 16 and 32 and the
contiguous cache; fp32 within 1e-5, bf16 against the fp32 reference within bf16's output
rounding. ``"auto"`` picks it on CPU where it builds; sizes it cannot serve fall back or are
refused by name."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from test_attention_backends import HEAD_DIM, HEADS, NUM_BLOCKS, random_step, run_both
from atlas_vlm.kernels import decode_kernel
from atlas_vlm.layers.attention import build_attention_metadata, resolve_attention_backend
from mm_kv_cache_management import ContiguousKVCache, KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.text
HAS_COMPILER = shutil.which(os.environ.get("CC") or "cc") is not None or shutil.which("gcc") is not None


def test_builds_where_a_compiler_is_and_auto_picks_it():
    assert decode_kernel.available() == HAS_COMPILER
    expected = "decode_kernel" if HAS_COMPILER else "bucketed"
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_attention_backend("auto", "cpu", dtype, HEADS, 2, HEAD_DIM) == expected
    assert resolve_attention_backend("bucketed", "cpu", torch.float32, HEADS, 2, HEAD_DIM) == "bucketed"


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, why", [
    (torch.float16, 8, 2, 64, "float32 or bfloat16"),
    (torch.float32, 8, 2, 512, "head_dim <= 256"),
    (torch.float32, 32, 1, 64, "query heads per KV head"),
])
def test_sizes_it_cannot_serve_fall_back_or_are_refused(dtype, heads, kv_heads, head_dim, why):
    assert resolve_attention_backend("auto", "cpu", dtype, heads, kv_heads, head_dim) == "bucketed"
    with pytest.raises(ValueError, match=why):
        resolve_attention_backend("decode_kernel", "cpu", dtype, heads, kv_heads, head_dim)
    assert "CPU only" in decode_kernel.unsupported_reason("cuda", torch.float32, 8, 2, 64)


def filled(dtype, kv_heads: int, block_size: int = 16, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(2, kv_heads, HEAD_DIM, dtype), NUM_BLOCKS * 16 // block_size, block_size)
    g = torch.Generator().manual_seed(seed)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=g))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=g))
    return cache


needs_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler: the kernel cannot exist here "
                                  "(test_builds_where_a_compiler_is_and_auto_picks_it checks the fallback)")


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_seqs, decode_share", [(32, 1.0), (12, 0.7), (1, 1.0)])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_kernel_equals_reference_fp32(seed, num_seqs, decode_share, kv_heads):
    rng = random.Random(seed)
    q_lens, c_lens, slots, tables = random_step(rng, num_seqs, decode_share)
    results = run_both(filled(torch.float32, kv_heads, seed=seed), q_lens, c_lens, slots, tables, seed,
                       backends=("reference", "decode_kernel"))
    (ref, ref_cache), (ours, our_cache) = results["reference"], results["decode_kernel"]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert torch.equal(our_cache.k_cache, ref_cache.k_cache) and torch.equal(our_cache.v_cache, ref_cache.v_cache)


@needs_kernel
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_kernel_in_bf16_matches_the_fp32_reference(kv_heads):
    q_lens, c_lens, slots, tables = random_step(random.Random(5), 24, 0.8)
    bf16 = filled(torch.bfloat16, kv_heads, seed=5)
    fp32 = PagedKVCache(KVCacheSpec(2, kv_heads, HEAD_DIM, torch.float32), NUM_BLOCKS, 16)
    fp32.k_cache.copy_(bf16.k_cache)
    fp32.v_cache.copy_(bf16.v_cache)
    results = run_both(bf16, q_lens, c_lens, slots, tables, 5, reference_cache=fp32,
                       backends=("reference", "decode_kernel"))
    (ref, _), (ours, _) = results["reference"], results["decode_kernel"]
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=1e-2)
    assert (ours.float() - ref).abs().mean() < 2e-3


@needs_kernel
def test_kernel_with_32_token_blocks_and_on_the_contiguous_cache():
    rng = random.Random(9)
    c_lens = [rng.randint(2, 200) for _ in range(10)]
    free = list(range(1, NUM_BLOCKS // 2))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // 32))] for c in c_lens]
    slots = [t[(c - 1) // 32] * 32 + (c - 1) % 32 for t, c in zip(tables, c_lens)]
    results = run_both(filled(torch.float32, 2, block_size=32, seed=9), [1] * 10, c_lens, slots, tables, 9,
                       backends=("reference", "decode_kernel"))
    torch.testing.assert_close(results["decode_kernel"][0], results["reference"][0], atol=1e-5, rtol=0)

    cache = ContiguousKVCache(KVCacheSpec(2, 2, HEAD_DIM, torch.float32), max_num_seqs=4, max_model_len=64)
    cache.k_cache.normal_(generator=torch.Generator().manual_seed(0))
    cache.v_cache.normal_(generator=torch.Generator().manual_seed(1))
    q_lens, c_lens, tables = [1, 5, 1], [40, 9, 64], [[2], [0], [3]]
    slots = [2 * 64 + 39] + [0 * 64 + p for p in range(4, 9)] + [3 * 64 + 63]
    results = run_both(cache, q_lens, c_lens, slots, tables, 4, backends=("reference", "decode_kernel"))
    torch.testing.assert_close(results["decode_kernel"][0], results["reference"][0], atol=1e-5, rtol=0)


@needs_kernel
def test_decode_requests_form_one_batch():
    meta = build_attention_metadata([1, 3, 1], [20, 3, 7], list(range(5)), [[4, 5], [6], [7]],
                                    backend="decode_kernel")
    layout = meta.bucketed
    assert layout.decode_buckets == [] and [p.start for p in layout.prefills] == [1]
    assert layout.decode_batch.token_index.tolist() == [0, 4]
    assert layout.decode_batch.context_lens.tolist() == [20, 7]
    assert layout.decode_batch.block_tables.tolist() == [[4, 5], [7, 0]]


@needs_kernel
def test_verification_rows_are_decode_rows_of_the_batch():
    # request 1 verifies 2 drafts (3 rows at positions 7, 8, 9), request 3 is a prefill chunk
    meta = build_attention_metadata([1, 3, 1, 2], [20, 10, 7, 2], list(range(7)), [[4, 5], [6], [7], [8]],
                                    backend="decode_kernel", verify=[False, True, False, False])
    d = meta.bucketed.decode_batch
    assert [p.start for p in meta.bucketed.prefills] == [5] and not d.all_tokens
    assert d.token_index.tolist() == [0, 1, 2, 3, 4] and d.context_lens.tolist() == [20, 8, 9, 10, 7]
    assert d.block_tables.tolist() == [[4, 5], [6, 0], [6, 0], [6, 0], [7, 0]]
    only = build_attention_metadata([3, 1], [10, 7], list(range(4)), [[6], [7]], backend="decode_kernel",
                                    verify=[True, False]).bucketed
    assert only.decode_batch.all_tokens and only.prefills == []  # a drafted step: decode rows only
    ref = build_attention_metadata([3, 1], [10, 7], list(range(4)), [[6], [7]], backend="bucketed",
                                   verify=[True, False]).bucketed
    assert [p.start for p in ref.prefills] == [0]  # other backends: a prefill chunk, as before
    with pytest.raises(ValueError, match="verify has 1 flags for 2 requests"):
        build_attention_metadata([3, 1], [10, 7], list(range(4)), [[6], [7]], verify=[True])


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_rows_equal_the_reference(seed, dtype):
    """A step of decode rows, verification rows (1 + 1..4 drafts over cached context) and
    prefill chunks: each verification row through the kernel attends its request's keys up
    to its own; the reference's values (within 1e-5 in fp32, bf16's rounding in bf16) and
    the same cache writes."""
    rng = random.Random(seed)
    free = rng.sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)
    q_lens, c_lens, slots, tables, verify = [], [], [], [], []
    for kind in ["decode", "verify", "prefill", "verify", "decode", "verify"]:
        c = rng.randint(6, 300)
        q = {"decode": 1, "verify": rng.randint(2, 5), "prefill": rng.randint(2, c)}[kind]
        table = [free.pop() for _ in range(-(-c // 16))]
        q_lens.append(q), c_lens.append(c), tables.append(table), verify.append(kind == "verify")
        slots += [table[p // 16] * 16 + p % 16 for p in range(c - q, c)]
    results = run_both(filled(dtype, 2, seed=seed), q_lens, c_lens, slots, tables, seed,
                       backends=("reference", "decode_kernel"), verify=verify)
    (ref, ref_cache), (ours, our_cache) = results["reference"], results["decode_kernel"]
    torch.testing.assert_close(ours.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    assert torch.equal(our_cache.k_cache, ref_cache.k_cache) and torch.equal(our_cache.v_cache, ref_cache.v_cache)


@needs_kernel
def test_a_context_past_its_block_table_is_refused():
    cache = filled(torch.float32, 2)
    q = torch.randn(1, HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="refused the sizes"):
        decode_kernel.paged_decode_attention(q, cache.k_cache[0], cache.v_cache[0], torch.tensor([[3]]),
                                             torch.tensor([17]), HEAD_DIM ** -0.5)


@needs_kernel
def test_mismatched_dtypes_are_refused():
    cache = filled(torch.float32, 2)
    with pytest.raises(ValueError, match="q's dtype"):
        decode_kernel.paged_decode_attention(torch.randn(1, HEADS, HEAD_DIM).bfloat16(), cache.k_cache[0],
                                             cache.v_cache[0], torch.tensor([[3]]), torch.tensor([5]), 0.1)


TARGETS = {"x86-64-v4": "avx512f avx512bw avx512cd avx512dq avx512vl avx avx2 fma f16c",
           "x86-64-v3": "avx avx2 fma f16c", None: "sse2"}


@needs_kernel
@pytest.mark.parametrize("march", list(TARGETS), ids=lambda m: m or "default-target")
def test_kernel_built_for_each_cpu_target_equals_reference(monkeypatch, march):
    """The kernel built as on an AVX-512, an AVX2-only or a pre-AVX2 CPU (faked flags pick the
    ``-march``) gives the reference's answer. Each target runs where this CPU has its
    instructions (every x86-64 runs the default target); the others skip, naming them."""
    from atlas_vlm import hardware
    from atlas_vlm.hardware import CpuFeatures

    real = hardware.cpu_features()
    wanted = set(TARGETS[march].split()) - {"sse2"}
    if not real.x86 and march is not None:
        pytest.skip(f"-march={march} is an x86-64 target; this CPU is {real.machine}")
    if not wanted <= real.flags:
        pytest.skip(f"-march={march} needs {sorted(wanted - real.flags)}, which this CPU lacks")
    monkeypatch.setattr(hardware, "cpu_features", lambda: CpuFeatures(frozenset(TARGETS[march].split()), real.machine))
    decode_kernel._library.cache_clear()
    try:
        assert [f for f in decode_kernel._compile_flags() if f.startswith("-march")] == (
            [f"-march={march}"] if march and real.x86 else [])
        assert decode_kernel.available()
        q_lens, c_lens, slots, tables = random_step(random.Random(3), 16, 0.8)
        results = run_both(filled(torch.float32, 2, seed=3), q_lens, c_lens, slots, tables, 3,
                           backends=("reference", "decode_kernel"))
        torch.testing.assert_close(results["decode_kernel"][0], results["reference"][0], atol=1e-5, rtol=0)
    finally:
        decode_kernel._library.cache_clear()
