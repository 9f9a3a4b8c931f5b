"""8-bit K/V storage (``mm_kv_cache_management.kv_quant``, ``kv_cache_dtype`` "int8" /
"fp8_e4m3"): the Hadamard rotation orthonormal and its own inverse in fp32 (attention in the
rotated basis equals attention in the model's), the per-token-head round trip within its
rounding bound (per element in the rotated basis, in L2 after rotating back), zeros exact, the
paged and contiguous caches storing and returning the same values, the bytes a token takes,
and bad names refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_vlm.config import EngineConfig
from mm_kv_cache_management import ContiguousKVCache, KVCacheSpec, PagedKVCache
from mm_kv_cache_management.kv_quant import (dequantize_per_token_head, hadamard_block, hadamard_rotate,
                                             quantize_per_token_head)

pytestmark = pytest.mark.text
FORMATS = ("int8", "fp8_e4m3")


def _bound(x: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Worst-case |x - dequant(quant(x))| per element: half a code step (int8), 2^-4 relative /
    2^-10 of the scale below e4m3's normal range (fp8); plus the float16 scale's rounding."""
    s = scale.float().unsqueeze(-1)
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    scale_rounding = qmax * s * 2.0 ** -10  # the fp16 scale is within 2^-11 of amax / QMAX: clamped codes
    if kv_dtype == "int8":
        return s / 2 + scale_rounding + 1e-6
    return torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10) + scale_rounding + 1e-6


@settings(max_examples=60, deadline=None)
@given(kv_dtype=st.sampled_from(FORMATS), tokens=st.integers(1, 9), heads=st.integers(1, 4),
       magnitude=st.sampled_from([1e-3, 1.0, 30.0, 2000.0]), seed=st.integers(0, 2 ** 16))
def test_round_trip_within_the_rounding_bound(kv_dtype, tokens, heads, magnitude, seed):
    x = torch.randn(tokens, heads, 64, generator=torch.Generator().manual_seed(seed)) * magnitude
    codes, scale = quantize_per_token_head(x, kv_dtype)
    assert codes.shape == x.shape and scale.shape == (tokens, heads) and scale.dtype == torch.float16
    rotated = hadamard_rotate(x)  # what the codes encode
    values = codes.view(torch.float8_e4m3fn).float() if kv_dtype == "fp8_e4m3" else codes.float()
    bound = _bound(rotated, scale, kv_dtype).expand_as(rotated)  # [tokens, heads, 64]
    assert (values * scale.float().unsqueeze(-1) - rotated).abs().le(bound).all()
    back = dequantize_per_token_head(codes, scale, kv_dtype, torch.float32)  # rotated back: L2 error kept
    assert (back - x).norm(dim=-1).le(bound.norm(dim=-1) * (1 + 1e-5)).all()
    if kv_dtype == "int8":  # the largest value of each row takes the full code range, unless the
        # row is so small that amax / 127 is below float16's smallest normal scale (2^-14)
        full = rotated.abs().amax(dim=-1) / 127 >= 2.0 ** -14
        assert codes.abs().amax(dim=-1)[full].ge(126).all()


@pytest.mark.parametrize("head_dim, block", [(64, 64), (128, 128), (24, 8), (80, 16), (7, 1)])
def test_the_rotation_is_orthonormal_and_its_own_inverse_in_fp32(head_dim, block):
    assert hadamard_block(head_dim) == block
    x = torch.randn(5, 3, head_dim, generator=torch.Generator().manual_seed(head_dim))  # [tokens, heads, head_dim]
    rotated = hadamard_rotate(x)
    torch.testing.assert_close(hadamard_rotate(rotated), x, atol=1e-5, rtol=0)  # rotate + unrotate == x
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-6)
    h = hadamard_rotate(torch.eye(head_dim))  # the matrix: block-diagonal, entries +-1/sqrt(block)
    assert torch.allclose(h, h.T) and torch.allclose(h @ h, torch.eye(head_dim), atol=1e-6)
    assert torch.allclose(h.abs().sum(dim=-1), torch.full((head_dim,), block ** 0.5))


def test_attention_in_the_rotated_basis_equals_attention_in_the_models():
    """What the decode kernel computes (rotated q against rotated K/V, the output rotated back)
    is the model's attention, exactly up to fp32 rounding, without quantization."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 37, 64, generator=g) for _ in range(3))  # [heads, tokens, head_dim]
    ref = torch.softmax(q @ k.transpose(1, 2) / 8, dim=-1) @ v
    rot = hadamard_rotate(torch.softmax(hadamard_rotate(q) @ hadamard_rotate(k).transpose(1, 2) / 8, dim=-1)
                          @ hadamard_rotate(v))
    torch.testing.assert_close(rot, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_zero_rows_come_back_exactly(kv_dtype):
    x = torch.zeros(3, 2, 16)
    x[1, 0, 5] = -7.25  # one nonzero row beside zero rows
    codes, scale = quantize_per_token_head(x, kv_dtype)
    back = dequantize_per_token_head(codes, scale, kv_dtype, torch.float32)
    assert torch.equal(back[0], x[0]) and torch.equal(back[2], x[2]) and torch.equal(back[1, 1], x[1, 1])
    assert back[1, 0, 5].item() == pytest.approx(-7.25, rel=2 ** -10)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_an_8_bit_token_takes_at_most_0_53x_the_bytes_of_bf16(kv_dtype, head_dim):
    bf16 = KVCacheSpec(4, 2, head_dim, torch.bfloat16)
    q8 = KVCacheSpec(4, 2, head_dim, torch.bfloat16, kv_dtype)
    assert q8.bytes_per_token == 2 * 4 * 2 * (head_dim + 2)  # codes + one fp16 scale per head
    assert bf16.bytes_per_token / q8.bytes_per_token >= 1.9
    cache = PagedKVCache(q8, num_blocks=3, block_size=16)
    assert cache.nbytes == 3 * 16 * q8.bytes_per_token
    assert PagedKVCache.num_blocks_for_budget(cache.nbytes, q8, 16) == 3


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_paged_and_contiguous_store_and_return_the_same_values(kv_dtype):
    spec = KVCacheSpec(2, 2, 8, torch.float32, kv_dtype)
    paged, contiguous = PagedKVCache(spec, num_blocks=8, block_size=4), ContiguousKVCache(spec, 2, 16)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 2, 8, generator=g) * 3
    paged_slots = torch.tensor([5 * 4 + i for i in range(4)] + [2 * 4 + i for i in range(4)] + [7 * 4, 7 * 4 + 1])
    paged.write(1, paged_slots, k, v)
    contiguous.write(1, torch.arange(16, 26), k, v)
    pk, pv = paged.gather_kv_for_attention(1, torch.tensor([[5, 2, 7]]), 10)
    ck, cv = contiguous.gather_kv_for_attention(1, torch.tensor([[1]]), 10)
    assert torch.equal(pk, ck) and torch.equal(pv, cv) and pk.dtype == torch.float32
    codes, scale = quantize_per_token_head(k, kv_dtype)
    assert torch.equal(pk[0], dequantize_per_token_head(codes, scale, kv_dtype, torch.float32))
    assert not torch.equal(pk[0], k)  # stored in 8 bits: not the fp32 values
    assert paged.k_cache.element_size() == 1 and paged.k_scale.shape == (2, 8, 4, 2)


def test_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8_e4m3'\), got 'int4'"):
        EngineConfig(model="unused", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        KVCacheSpec(1, 1, 8, torch.float32, "q8_0")
