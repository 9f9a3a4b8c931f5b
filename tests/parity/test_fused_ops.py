"""The fused small ops (``atlas_vlm.kernels.fused``: RMSNorm with the residual add, SwiGLU,
q/k norm + RoPE + K/V write) against their PyTorch references: bf16 bit-equal (the C code
rounds where the references round), fp32 within a few ulp (reduction order, expf); a bad
slot is refused before anything is written; the engine equals itself with the C path faked
off (tokens and logits), and the C path is what runs where it builds."""

from __future__ import annotations

import pytest
import torch

from helpers import greedy
from atlas_vlm import LLM
from atlas_vlm.kernels import fused
from atlas_vlm.models.decoder import RMSNorm
from mm_kv_cache_management import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.text
DTYPES = (torch.float32, torch.bfloat16)
FP32_ATOL = 4e-6  # measured <= 1e-6 on values of magnitude ~1-4


@pytest.fixture(autouse=True)
def _needs_kernel():
    if not fused.available():
        pytest.skip("no C compiler here: the fused ops cannot be built (test_reference_runs_without_the_library "
                    "checks the fallback)")


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    if ours.dtype == torch.bfloat16:  # equal, but where an fp32 statistic's last bit moves a rounding: one ulp
        diff = (ours.float() - ref.float()).abs()
        assert bool((diff <= ref.float().abs() * 2.0**-7).all())
        assert (diff > 0).float().mean().item() <= 0.01, (diff > 0).float().mean().item()
    else:
        torch.testing.assert_close(ours, ref, atol=FP32_ATOL, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (33, 1000)])
def test_rms_norm_with_and_without_residual(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    res = torch.randn(rows, dim, generator=g).to(dtype)
    out, none = fused.rms_norm(x, w, 1e-6)
    ref, _ = fused.rms_norm_reference(x, w, 1e-6)
    assert none is None and out.dtype == dtype
    _close(out, ref)
    mine = res.clone()
    out, new_res = fused.rms_norm(x, w, 1e-6, mine)
    ref, ref_res = fused.rms_norm_reference(x, w, 1e-6, res.clone())
    assert new_res is mine  # updated in place, as vLLM's fused_add_rms_norm
    assert torch.equal(new_res, ref_res)  # the residual add rounds exactly as PyTorch's
    _close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gu = (torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gu[0, :4] = torch.tensor([0.0, -80.0, 80.0, float("nan")])
    ours, ref = fused.silu_and_mul(gu), fused.silu_and_mul_reference(gu)
    assert ours.shape == (5, 1536) and torch.isnan(ours[0, 3]) and torch.isnan(ref[0, 3])
    ours[0, 3] = ref[0, 3] = 0
    _close(ours, ref)


def test_rows_longer_than_the_c_bound_take_the_reference():
    gu = torch.randn(2, 2 * (fused.MAX_NORM_DIM + 8))  # e.g. Qwen2.5-7B's 18,944-wide MLP
    assert torch.equal(fused.silu_and_mul(gu), fused.silu_and_mul_reference(gu))
    x, w = torch.randn(2, fused.MAX_NORM_DIM + 8), torch.randn(fused.MAX_NORM_DIM + 8)
    assert torch.equal(fused.rms_norm(x, w, 1e-6)[0], fused.rms_norm_reference(x, w, 1e-6)[0])


def _cache(dtype, kv_heads: int, head_dim: int) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(3, kv_heads, head_dim, dtype), num_blocks=8, block_size=4)
    g = torch.Generator().manual_seed(5)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=g))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=g))
    return cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_rope_write_kv(dtype, qk_norm, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads + head_dim)
    t = 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(t, head_dim // 2, generator=g) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    norms = (None, None)
    if qk_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6) for _ in range(2))
        for n in norms:
            n.weight.data = torch.randn(head_dim, generator=g)
            n.to(dtype)
    slots = torch.tensor([3, 17, 0, 31, 8, 9])
    ours_cache, ref_cache = _cache(dtype, kv_heads, head_dim), _cache(dtype, kv_heads, head_dim)
    q = fused.rope_write_kv(qkv, cos, sin, heads, kv_heads, head_dim, ours_cache, 1, slots, *norms)
    q_ref = fused.rope_write_kv_reference(qkv, cos, sin, heads, kv_heads, head_dim, ref_cache, 1, slots, *norms)
    assert q.shape == (t, heads, head_dim)
    _close(q, q_ref)
    _close(ours_cache.k_cache, ref_cache.k_cache)
    assert torch.equal(ours_cache.v_cache, ref_cache.v_cache)  # V is copied as is; other layers untouched


def test_a_slot_outside_the_cache_writes_nothing():
    cache = _cache(torch.float32, 2, 16)
    before = cache.k_cache.clone(), cache.v_cache.clone()
    qkv = torch.randn(2, (4 + 4) * 16)
    cs = torch.ones(2, 16)
    with pytest.raises(RuntimeError, match="slot outside"):
        fused.rope_write_kv(qkv, cs, cs * 0, 4, 2, 16, cache, 0, torch.tensor([1, 32]))  # 8 blocks x 4 = 32 slots
    assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1])


def _run(folder, dtype, monkeypatch, on: bool):
    monkeypatch.setattr(fused, "available", lambda: on)
    llm = LLM(str(folder), dtype=dtype, max_model_len=128, num_kvcache_blocks=16)
    logits = []
    llm.engine.runner.observers.append(lambda chunks, inp, lg, sampled: logits.append(lg.clone()))
    out = llm.generate([list(range(100, 130)), list(range(200, 211))], greedy(12), use_tqdm=False)
    return [o.token_ids for o in out], logits


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_engine_with_and_without_the_fused_ops(family, tiny_models, monkeypatch):
    folder, _ = tiny_models[family]
    calls = []
    real = fused._library()
    monkeypatch.setattr(fused, "_library", lambda: (calls.append(1), real)[1])
    tokens_on, logits_on = _run(folder, "float32", monkeypatch, True)
    assert calls  # the C path ran
    tokens_off, logits_off = _run(folder, "float32", monkeypatch, False)
    assert tokens_on == tokens_off
    for a, b in zip(logits_on, logits_off):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_reference_runs_without_the_library(monkeypatch):
    monkeypatch.setattr(fused, "_library", lambda: None)
    x, w = torch.randn(2, 8), torch.randn(8)
    assert not fused.available()
    assert torch.equal(fused.rms_norm(x, w, 1e-6)[0], fused.rms_norm_reference(x, w, 1e-6)[0])
    gu = torch.randn(2, 16)
    assert torch.equal(fused.silu_and_mul(gu), fused.silu_and_mul_reference(gu))
