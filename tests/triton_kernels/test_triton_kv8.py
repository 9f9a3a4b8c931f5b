"""8-bit KV in the ``"triton"`` backend (``kernels/triton_kv8``, ``triton_attention``'s
KV_QUANT path) against the PyTorch reference: the KV write gives the very codes and scales
``PagedKVCache.write`` gives (int8 and fp8_e4m3: bit for bit); attention over an 8-bit cache
agrees with the ``"reference"`` backend (dequantize, rotate back, SDPA) over the same cache to
fp32 rounding: |diff| <= 1e-5 + 1e-5 * |ref| (the two differ only in where the Hadamard
rotation is applied: on q and the output here, on each K / V row there); the engine with
``attention_backend="triton"`` and an int8 cache gives the reference backend's greedy tokens.
Small shapes, few examples: on CPU the interpreter runs every program in numpy."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from helpers import CPU_FP32
from test_triton_kernels import random_step
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.kernels.triton_kv8 import fp8e4m3_decode, fp8e4m3_encode, reshape_and_cache_kv8
from atlas_vlm.layers.attention import build_attention_metadata, paged_attention, resolve_attention_backend
from mm_kv_cache_management import ContiguousKVCache, KVCacheSpec, PagedKVCache

pytestmark = [pytest.mark.text, pytest.mark.triton]

FORMATS = ("int8", "fp8_e4m3")
FEW = settings(max_examples=15, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@triton.jit
def _fp8_round_trip_kernel(y_ptr, code_ptr, all_codes_ptr, value_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(code_ptr + offs, fp8e4m3_encode(tl.load(y_ptr + offs)))
    offs_c = tl.arange(0, 256)
    tl.store(value_ptr + offs_c, fp8e4m3_decode(tl.load(all_codes_ptr + offs_c)))


def test_fp8_codes_encode_and_decode_as_torch():
    """Every finite e4m3 value, the midpoints between neighbours (ties to even), a hair
    either side of them, subnormals, +-0 and +-448: torch's cast, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF: NaN
    values = finite.view(torch.float8_e4m3fn).float().sort().values.unique()  # [-448 .. 448], -0 folded
    mids = (values[1:] + values[:-1]) / 2
    y = torch.cat([values, mids, mids.nextafter(values[1:]), mids.nextafter(values[:-1]), torch.tensor([-0.0])])
    y = torch.cat([y, torch.zeros(1024 - y.numel())])
    out_codes, out_values = torch.empty(1024, dtype=torch.uint8), torch.empty(256)
    _fp8_round_trip_kernel[(1,)](y.to(DEVICE), out_codes.to(DEVICE), codes.to(DEVICE), out_values.to(DEVICE), N=1024)
    assert torch.equal(out_codes.cpu(), y.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(out_values.cpu()[finite.long()], finite.view(torch.float8_e4m3fn).float())


@FEW
@given(num_tokens=st.integers(1, 10), kv_heads=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([64, 80]),
       fmt=st.sampled_from(FORMATS), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_kv8_write_matches_the_cache_write(num_tokens, kv_heads, head_dim, fmt, dtype, seed):
    """Rows over ten decades (outlier channels, scales at float16's floor) and an all-zero row."""
    block_size, num_blocks = 4, 6
    ours = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, dtype, fmt), num_blocks, block_size, device=DEVICE)
    ref = copy.deepcopy(ours)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    k, v = torch.randn(2, num_tokens, kv_heads, head_dim, generator=g) * torch.logspace(-8, 2, head_dim)
    k[0, 0] = 0.0
    k, v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
    reshape_and_cache_kv8(k, v, *ours.layer_kv(0), slots, fmt)
    ref.write(0, slots, k, v)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def test_kv8_write_skips_negative_slots_and_refuses_wrong_codes():
    cache = PagedKVCache(KVCacheSpec(1, 2, 64, torch.float32, "int8"), 2, 4, device=DEVICE)
    k = torch.ones(2, 2, 64, device=DEVICE)
    reshape_and_cache_kv8(k, k, *cache.layer_kv(0), torch.tensor([-1, 5], device=DEVICE), "int8")
    assert (cache.k_scale[0].view(-1, 2) != 0).any(dim=1).tolist() == [False] * 5 + [True] + [False] * 2
    with pytest.raises(ValueError, match="fp8_e4m3 codes must be torch.uint8"):
        reshape_and_cache_kv8(k, k, *cache.layer_kv(0), torch.tensor([0, 1], device=DEVICE), "fp8_e4m3")


def filled_kv8_cache(fmt, kv_heads, head_dim, num_blocks, block_size, args, seed) -> PagedKVCache:
    """An 8-bit cache whose every context slot of the step (``args``) is written by the reference."""
    q_lens, c_lens, _, tables = args
    cache = PagedKVCache(KVCacheSpec(1, kv_heads, head_dim, torch.float32, fmt), num_blocks, block_size, device=DEVICE)
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size for t, c in zip(tables, c_lens)
                          for p in range(c)], device=DEVICE)
    k, v = torch.randn(2, slots.numel(), kv_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    cache.write(0, slots, k.to(DEVICE), v.to(DEVICE))
    return cache


@FEW
@given(splits=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 8)), min_size=1, max_size=3),
       head_dim=st.sampled_from([64, 80]), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3, 4]),
       fmt=st.sampled_from(FORMATS), block_size=st.sampled_from([4, 16]), seed=st.integers(0, 2 ** 16))
def test_attention_over_an_8bit_cache_matches_the_reference(splits, head_dim, kv_heads, group, fmt, block_size, seed):
    """Random block tables; cached prefixes with new tokens (prefill, chunk, decode) per request."""
    num_blocks = 24
    args = random_step(random.Random(seed), splits, block_size, num_blocks)
    cache = filled_kv8_cache(fmt, kv_heads, head_dim, num_blocks, block_size, args, seed)
    q = torch.randn(sum(args[0]), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    out = {}
    for backend in ("reference", "triton"):
        meta = build_attention_metadata(*args, device=DEVICE, backend=backend)
        out[backend] = paged_attention(q.to(DEVICE), None, None, cache, 0, meta, head_dim ** -0.5)
    assert out["triton"].dtype == torch.float32 and out["triton"].shape == q.shape
    assert_close(out["triton"], out["reference"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_triton_backend_writes_and_reads_an_8bit_cache(kind, fmt):
    """The backend as layers call it (new K/V given: the Triton write, then the kernel); a
    mixed step (decode row, chunk over a prefix, fresh prefill), head_dim 80 (rotation blocks of 16)."""
    heads, kv_heads, head_dim, bs = 4, 2, 80, 4
    q_lens, c_lens, slots, tables = random_step(random.Random(0), [(9, 1), (6, 5), (0, 7)], bs, 12)
    spec = KVCacheSpec(1, kv_heads, head_dim, torch.float32, fmt)
    cache = PagedKVCache(spec, 12, bs, device=DEVICE)
    if kind == "contiguous":
        cache, tables = ContiguousKVCache(spec, 3, 16, device=DEVICE), [[2], [0], [1]]
        slots = [t[0] * 16 + p for t, q, c in zip(tables, q_lens, c_lens) for p in range(c - q, c)]
    g = torch.Generator().manual_seed(1)
    prefix = [t[0] * 16 + p if kind == "contiguous" else t[p // bs] * bs + p % bs
              for t, q, c in zip(tables, q_lens, c_lens) for p in range(c - q)]
    cache.write(0, torch.tensor(prefix, device=DEVICE), *torch.randn(2, len(prefix), kv_heads, head_dim, generator=g))
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(DEVICE)
    k, v = torch.randn(2, sum(q_lens), kv_heads, head_dim, generator=g).to(DEVICE)
    results = {}
    for backend in ("reference", "triton"):
        c = copy.deepcopy(cache)
        meta = build_attention_metadata(q_lens, c_lens, slots, tables, device=DEVICE, backend=backend)
        results[backend] = paged_attention(q, k, v, c, 0, meta, head_dim ** -0.5), c
    (ref, ref_cache), (ours, our_cache) = results["reference"], results["triton"]
    assert_close(ours, ref)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert torch.equal(getattr(our_cache, name), getattr(ref_cache, name)), name


def test_forced_triton_serves_8bit_kv_under_the_interpreter():
    for fmt in FORMATS:
        assert resolve_attention_backend("triton", DEVICE, torch.float32, 4, 2, 80, kv_cache_dtype=fmt) == "triton"
        assert resolve_attention_backend("auto", "cuda", torch.bfloat16, 4, 2, 80, kv_cache_dtype=fmt) == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine on CPU tensors needs the interpreter")
def test_engine_int8_kv_greedy_tokens_match_the_reference(tiny_models):
    """Mixed prompt lengths, chunked prefill next to decodes (16-token steps), an int8 cache on
    both sides; qwen3's head_dim 24 (rotation blocks of 8) padded to 32 in the kernel."""
    folder = str(tiny_models["qwen3"][0])
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(n)] for i, n in enumerate([3, 21, 9])]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "triton"):
        llm = LLM(folder, max_model_len=64, num_kvcache_blocks=16, max_num_batched_tokens=16,
                  attention_backend=backend, kv_cache_dtype="int8", **CPU_FP32)
        assert llm.engine.runner.attention_backend == backend
        assert llm.engine.runner.kv_cache.spec.kv_cache_dtype == "int8"
        tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["reference"] and all(len(t) == 4 for t in tokens["triton"])
