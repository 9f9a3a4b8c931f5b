"""The GGUF stored-block kernels (``kernels/gguf_kernel.py``, ``csrc/gguf_gemm.c``) on Q4_K,
Q5_K, Q6_K and Q8_0, and the 16-row interleaved kernels (``repack`` + ``gguf_matmul_packed``)
on Q4_K, Q6_K and Q8_0: against ``gguf``'s dequantize + ``F.linear`` within the bound q8_K's
rounding allows, against the same product with the activations quantized to q8_K in numpy
(exact integers: fp32 rounding only), every variant this CPU runs (AVX512-VNNI, AVX2, plain C;
``ATLAS_VLM_CPU_FLAGS`` fakes a smaller CPU) against that, over shapes from hypothesis.

Weights are random bytes (every bit pattern of scales, mins and quants) with sane fp16 scales.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from atlas_vlm import hardware
from atlas_vlm.hardware import X86_64_V3, X86_64_V4
from atlas_vlm.kernels import cbuild, gguf_kernel
from atlas_vlm.kernels.gguf_kernel import (PACKED_TYPES, TYPES, gguf_matmul, gguf_matmul_packed, gguf_matmul_reference,
                                           repack)

pytestmark = pytest.mark.text

QTYPES = sorted(TYPES)
# kernel vs the same product on q8_K activations in float64: fp32 rounding of the per-block
# products and sums only; max |diff| / max |reference| (measured <= 1e-6)
Q8K_EXACT_REL = 1e-5
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}  # fp16 offsets in a block


def _blocks(qtype: str, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, row bytes]: random blocks of ``qtype`` with fp16 scales in +-[1e-3, 2e-3]."""
    rng = np.random.default_rng(seed)
    _, per, nbytes = TYPES[qtype]
    b = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        d = rng.uniform(1e-3, 2e-3, (n, k // per)) * rng.choice([-1.0, 1.0], (n, k // per))
        b[..., off:off + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def _q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] fp32 -> (int8 values [M, K], fp32 scales [M, K / 256]) as the C kernel makes them."""
    m, k = x.shape
    v = x.astype(np.float32).reshape(m, k // 256, 256)
    d = (np.abs(v).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.rint(v * inv[..., None]).astype(np.int8)  # round half to even, as nearbyintf
    return q.reshape(m, k), d


def _weight(blocks: torch.Tensor, qtype: str) -> np.ndarray:
    return dequantize(blocks.numpy(), GGMLQuantizationType[qtype]).astype(np.float64)  # [N, K]


def _q8k_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> np.ndarray:
    q, d = _q8_k(x.float().numpy())
    xq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 256, axis=1)
    return xq @ _weight(blocks, qtype).T


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _variants() -> dict[str, object]:
    """Every kernel variant this CPU (``cpu_features``, faking honoured) runs, built."""
    cpu, base = hardware.cpu_features(), list(cbuild.BASE_FLAGS)
    out = {"plain C": gguf_kernel.load_variant(base)}
    if cpu.x86 and X86_64_V3 <= cpu.flags:
        out["AVX2"] = gguf_kernel.load_variant(base + ["-march=x86-64-v3"])
    if cpu.x86 and X86_64_V3 | X86_64_V4 <= cpu.flags and {"avx512_vnni", "avx512vnni"} & cpu.flags:
        out["AVX512-VNNI"] = gguf_kernel.load_variant(base + ["-march=x86-64-v4", "-mavx512vnni"])
    return out


@pytest.fixture(scope="module")
def variants():
    if cbuild.compiler() is None:
        pytest.skip("no C compiler: gguf_matmul is its reference")
    libs = _variants()
    assert all(lib is not None for lib in libs.values()), "a C compiler is here: every variant must build"
    want = {"plain C": "scalar", "AVX2": "avx2", "AVX512-VNNI": "avx512vnni"}
    assert {name: gguf_kernel.isa(lib) for name, lib in libs.items()} == {name: want[name] for name in libs}
    return libs


def test_default_variant_follows_the_cpu():
    cpu = hardware.cpu_features()
    if not gguf_kernel.available():
        pytest.skip("no C compiler")
    want = ("avx512vnni" if "-mavx512vnni" in cpu.int8_dot_flags else
            "avx2" if cpu.kernel_march in ("x86-64-v3", "x86-64-v4") else "scalar")
    assert gguf_kernel.isa() == want


@pytest.mark.parametrize("qtype", QTYPES)
def test_within_q8_k_rounding_of_the_fp32_reference(qtype):
    """|y - ref| <= sum_k |W[n, k]| * d_x(k) / 2 (each activation off by at most half its
    256-block's step d_x = amax / 127) plus fp32 slack: the bound q8_K's rounding allows."""
    n, k = 67, 768
    blocks, x = _blocks(qtype, n, k, seed=1), torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    ref = gguf_matmul_reference(x, blocks, qtype, n, k)
    ys = [gguf_matmul(x, blocks, qtype, n, k)]
    if qtype in PACKED_TYPES and gguf_kernel.available():
        ys.append(gguf_matmul_packed(x, repack(blocks, qtype, n, k), qtype, n, k))
    _, d = _q8_k(x.numpy())
    bound = 0.5 * np.repeat(d.astype(np.float64), 256, axis=1) @ np.abs(_weight(blocks, qtype)).T
    slack = Q8K_EXACT_REL * float(ref.abs().max())
    for y in ys:
        assert np.all(np.abs(y.double().numpy() - ref.double().numpy()) <= bound * 1.001 + slack)
        assert _rel(y, ref) < 3e-2  # the bound, in the figure docs/quantization.md states


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(QTYPES), m=st.sampled_from([1, 2, 3, 5, 7, 8, 9, 17, 32, 35]),
       n=st.integers(1, 40).map(lambda v: 2 * v + 1), k_blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_every_variant_is_the_q8_k_product(variants, qtype, m, n, k_blocks, seed):
    """Rows 1-8 (one weight read), 9+ and 32+ (several), odd N: each variant = the q8_K product."""
    k = 256 * k_blocks
    blocks = _blocks(qtype, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3.0
    ref = _q8k_reference(x, blocks, qtype)
    for name, lib in variants.items():
        y = gguf_matmul(x, blocks, qtype, n, k, lib=lib)
        assert y.shape == (m, n) and _rel(y, ref) <= Q8K_EXACT_REL, (name, qtype, m, n, k)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(PACKED_TYPES), m=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32, 37]),
       n=st.integers(1, 50), k_blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(qtype="Q6_K", m=37, n=33, k_blocks=2, seed=1)  # 9+ rows: Q6_K's group unpacked once (AVX512)
@example(qtype="Q8_0", m=9, n=17, k_blocks=1, seed=2)
def test_interleaved_kernels_are_the_q8_k_product_with_the_same_bits(variants, qtype, m, n, k_blocks, seed):
    """The 16-row kernels: rows 1-8 (one weight read), 9+ and 32+, N not a multiple of 16 (the
    zero-padded last group), every variant the q8_K product and all bit-equal (the same int32s,
    the same fp32 order; docs/quantization.md)."""
    k = 256 * k_blocks
    blocks = _blocks(qtype, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3.0
    ref = _q8k_reference(x, blocks, qtype)
    ys = {}
    for name, lib in variants.items():
        packed = repack(blocks, qtype, n, k, lib=lib)
        assert packed.numel() == -(-n // 16) * k_blocks * {"Q4_K": 2368, "Q6_K": 3360, "Q8_0": 4352}[qtype]
        ys[name] = gguf_matmul_packed(x, packed, qtype, n, k, lib=lib)
        assert ys[name].shape == (m, n) and _rel(ys[name], ref) <= Q8K_EXACT_REL, (name, qtype, m, n, k)
    first = next(iter(ys.values()))
    assert all(torch.equal(y, first) for y in ys.values()), (qtype, m, n, k)


def test_interleaved_nan_zero_rows_and_refusals(variants):
    n, k = 21, 512
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    x[1] = 0.0
    x[2, 7] = float("inf")
    for qtype in PACKED_TYPES:
        blocks = _blocks(qtype, n, k, seed=4)
        for name, lib in variants.items():
            y = gguf_matmul_packed(x, repack(blocks, qtype, n, k, lib=lib), qtype, n, k, lib=lib)
            assert torch.all(y[1] == 0) and torch.all(y[2].isnan()) and not y[[0, 3]].isnan().any(), name
    blocks = _blocks("Q4_K", n, k, seed=4)
    assert repack(_blocks("Q5_K", n, k, seed=4), "Q5_K", n, k) is None  # no interleaved kernel: stored rows
    with pytest.raises(ValueError, match="uint8"):
        repack(blocks, "Q4_K", n + 1, k)
    with pytest.raises(ValueError, match="packed must be"):
        gguf_matmul_packed(x, repack(blocks, "Q4_K", n, k), "Q6_K", n, k)
    with pytest.raises(ValueError, match="x must be"):
        gguf_matmul_packed(x[:, :256], repack(blocks, "Q4_K", n, k), "Q4_K", n, k)


def test_bf16_nan_and_zero_rows(variants):
    n, k = 9, 512
    blocks = _blocks("Q4_K", n, k, seed=3)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    x[1] = 0.0
    x[2, 300] = float("nan")
    for name, lib in variants.items():
        y = gguf_matmul(x, blocks, "Q4_K", n, k, lib=lib)
        assert torch.all(y[1] == 0) and torch.all(y[2].isnan()) and not y[[0, 3]].isnan().any(), name
        yb = gguf_matmul(x.bfloat16(), blocks, "Q4_K", n, k, lib=lib)
        assert yb.dtype == torch.bfloat16 and yb.shape == (4, n)
        assert _rel(yb[[0, 3]].float(), gguf_matmul(x.bfloat16().float(), blocks, "Q4_K", n, k, lib=lib)[[0, 3]]) <= 2**-8


def test_refusals_name_the_input():
    blocks = _blocks("Q6_K", 3, 256, seed=0)
    with pytest.raises(ValueError, match="Q3_K"):
        gguf_matmul(torch.zeros(1, 256), blocks, "Q3_K", 3, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_matmul(torch.zeros(1, 128), blocks, "Q6_K", 3, 128)
    with pytest.raises(ValueError, match=r"uint8 \[4, 210\]"):
        gguf_matmul(torch.zeros(1, 256), blocks, "Q6_K", 4, 256)
    with pytest.raises(ValueError, match="x must be"):
        gguf_matmul(torch.zeros(1, 512), blocks, "Q6_K", 3, 256)
    assert gguf_matmul(torch.zeros(0, 256), blocks, "Q6_K", 3, 256).shape == (0, 3)


def test_gguf_linear_reads_the_mapped_file_in_place(tmp_path):
    """GGUFLinear on a file's Q4_K and Q6_K tensors: its bytes lie inside the reader's map (no
    copy) and its output is gguf_matmul's on the same bytes (leading dims and bias kept)."""
    from gguf import GGUFReader, GGUFWriter

    from atlas_vlm.layers.gguf_linear import GGUFLinear, drop_mapped_pages

    path, k = tmp_path / "w.gguf", 512
    w = GGUFWriter(str(path), "llama")
    for name, qtype, n in [("blk.0.ffn_up.weight", "Q4_K", 33), ("blk.0.ffn_down.weight", "Q6_K", 17)]:
        w.add_tensor(name, _blocks(qtype, n, k, seed=n).numpy(), raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFReader(str(path))
    start, size = reader.data.ctypes.data, reader.data.nbytes
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(0))
    for t in reader.tensors:
        bias = torch.randn(int(t.shape[1]))
        layer = GGUFLinear.from_tensor(t, bias)  # (interleaved: the map's pages dropped, read back on demand)
        assert drop_mapped_pages(t.data) and not drop_mapped_pages(np.zeros(8, np.uint8))
        p = layer.blocks.untyped_storage().data_ptr()
        assert start <= p and p + layer.blocks.numel() <= start + size, t.name
        assert layer.blocks.numel() == int(t.n_bytes)
        y = layer(x)
        qtype, n = t.tensor_type.name, int(t.shape[1])
        if gguf_kernel.available():  # the rows interleaved once, in anonymous memory
            q = layer.packed.untyped_storage().data_ptr()
            assert not (start <= q < start + size) and torch.equal(layer.packed, repack(layer.blocks, qtype, n, k))
            want = gguf_matmul_packed(x.reshape(6, k), layer.packed, qtype, n, k) + bias
        else:
            assert layer.packed is None
            want = gguf_matmul(x.reshape(6, k), layer.blocks, qtype, n, k) + bias
        assert y.shape == (2, 3, n) and torch.equal(y.reshape(6, -1), want)
    with pytest.raises(ValueError, match="Q4_K"):
        GGUFLinear(torch.zeros(3, 10, dtype=torch.uint8), "Q4_K", 256, 3)


def test_without_a_kernel_it_is_the_reference(monkeypatch):
    monkeypatch.setattr(gguf_kernel, "_library", lambda: None)
    blocks, x = _blocks("Q5_K", 7, 256, seed=5), torch.randn(3, 256)
    assert not gguf_kernel.available() and gguf_kernel.isa() is None
    assert torch.equal(gguf_matmul(x, blocks, "Q5_K", 7, 256), gguf_matmul_reference(x, blocks, "Q5_K", 7, 256))
