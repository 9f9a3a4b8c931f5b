"""Quantized linear modules (``atlas_vlm.layers.quant_linear``) and their C kernel
(``kernels/quant_kernel.py``): the tile layout round-trips, round to nearest is within half a
step with fp16-exact scales, the C ``dequantize`` has the PyTorch one's bits, the kernel
equals its own definition (``kernel_reference``), every ISA variant this CPU runs gives the
plain C variant's bits, and the kernel switch follows the device and the build (faked)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from atlas_vlm import hardware
from atlas_vlm.hardware import X86_64_V3, X86_64_V4, CpuFeatures
from atlas_vlm.kernels import cbuild, quant_kernel
from atlas_vlm.layers.quant_linear import (KERNEL_MAX_ROWS, Int4Linear, Int8Linear, QuantEmbedding, dense_workspace,
                                           from_tiles, int4_group_size, pack_int4_row, quant_kernel_available,
                                           quantize_int4_rtn, quantize_int8_rtn, to_tiles, unpack_int4_row)

pytestmark = pytest.mark.text

# kernel vs kernel_reference in fp32: max |diff| / max |reference| (only the fp32 summation
# order differs; measured <= 8.0e-7 at K = 256, M up to 60)
KERNEL_FP32_REL = 5e-6
BF16_RTOL = 2.0**-7  # one bf16 step at most (both sides round their fp32 sums to bf16 once)
SHAPES = [("int8", None), ("int8", 32), ("int8", 16), ("int8min", 16), ("int8min", 32), ("int8min", 64), ("int4", 32),
          ("int4", 64), ("int4", 128)]  # groups of 16: GGUF Q6_K / Q3_K / Q2_K


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (NaNs compare equal, -0 differs from 0)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _module(kind: str, group: int | None, n: int = 200, k: int = 256, fp32_scales: bool = False,
            seed: int = 0) -> Int4Linear | Int8Linear:
    """A finalized module with the kernel on and a bias: round to nearest of a random dense
    layer (fp16 scales), or with ``fp32_scales`` random codes and scales not exact in fp16 (AWQ
    style, ``min = -z * s``; int8 with ``-128`` codes, as Q8_0 allows). ``"int8min"``: int8
    with mins (GGUF Q5_1 / Q5_K): random codes, scales and mins (fp16-rounded unless ``fp32_scales``)."""
    g = torch.Generator().manual_seed(seed)
    cls = Int4Linear if kind == "int4" else Int8Linear
    if kind == "int8min":
        m = Int8Linear(k, n, bias=True, group_size=group or k, has_min=True)
        groups = k // m.group_size
        s, mn = torch.rand(n, groups, generator=g) * 0.05 + 0.01, torch.randn(n, groups, generator=g)
        s, mn = (s, mn) if fp32_scales else (s.half().float(), mn.half().float())
        m.load_rows(0, torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), s, mn)
        m.bias.data.copy_(torch.randn(n, generator=g))
    elif not fp32_scales:
        torch.manual_seed(seed)
        m = cls.from_float(nn.Linear(k, n, bias=True), group)
    else:
        m = cls(k, n, bias=True, group_size=group or k)
        s = torch.rand(n, k // m.group_size, generator=g) * 0.05 + 0.01
        if kind == "int8":
            m.load_rows(0, torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), s)
        else:
            z = torch.randint(0, 16, s.shape, generator=g).float()
            m.load_rows(0, torch.randint(0, 16, (n, k), generator=g), s, -z * s)
        m.bias.data.copy_(torch.randn(n, generator=g))
    m.finalize(True)
    assert m.use_kernel and m.scales.dtype == (torch.float32 if fp32_scales else torch.float16)
    return m


def test_tile_layout_round_trips_and_unaligned_loads_equal_one_load():
    g = torch.Generator().manual_seed(0)
    n, k = 37, 64  # 37 rows: three tiles, the last with 11 padding rows
    q4 = torch.randint(0, 16, (n, k), generator=g)
    packed = pack_int4_row(q4)
    assert packed.shape == (n, k // 8, 4) and packed[5, 2, 3] == q4[5, 19] | (q4[5, 23] << 4)
    assert torch.equal(unpack_int4_row(packed), q4.to(torch.uint8))
    vals = torch.randn(n, 3, 4, generator=g)
    tiles = to_tiles(vals, (3, 4))
    assert tiles.shape == (3, 3, 16, 4) and torch.equal(tiles[2, :, 5:], torch.zeros(3, 11, 4))
    assert torch.equal(from_tiles(tiles, n), vals)

    s, mn = torch.rand(n, 2, generator=g), torch.randn(n, 2, generator=g)
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    for kind in ("int4", "int8"):
        whole, parts = (Int4Linear(k, n, group_size=32), Int4Linear(k, n, group_size=32)) if kind == "int4" else \
            (Int8Linear(k, n, group_size=32), Int8Linear(k, n, group_size=32))
        args = (q4, s, mn) if kind == "int4" else (q8, s)
        whole.load_rows(0, *args)
        for lo, hi in [(21, 37), (0, 5), (5, 21)]:  # out of order, across tile edges
            parts.load_rows(lo, *(a[lo:hi] for a in args))
        for name, t in whole.named_buffers():
            assert torch.equal(t, getattr(parts, name)), name
        assert whole.qweight.shape == ((3, k // 8, 16, 4) if kind == "int4" else (3, k // 4, 16, 4))
        if kind == "int4":  # row 21 = tile 1, row 5 in it
            assert torch.equal(whole.qweight[1, :, 5], packed[21]) and torch.equal(whole.unpacked(), q4.byte())
            assert torch.equal(whole.mins[1, :, 5], mn[21])
            want = q4.float() * s.repeat_interleave(32, 1) + mn.repeat_interleave(32, 1)
        else:
            assert whole.qweight[1, 7, 5, 2] == q8[21, 4 * 7 + 2]
            want = q8.float() * s.repeat_interleave(32, 1)
        assert torch.equal(whole.scales[1, :, 5], s[21]) and not whole.scales[2, :, 5:].any()  # padding rows 0
        assert torch.equal(whole.dequantize(), want)
        with pytest.raises(ValueError, match="do not fit"):
            whole.load_rows(30, *(a[:8] for a in args))  # rows 30..37 past 37
        with pytest.raises(ValueError, match="2 groups a row"):
            whole.load_rows(0, *(a[:, :1] if a.shape[1] == 2 else a for a in args))


def test_round_to_nearest_within_half_a_step_with_fp16_exact_scales():
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    slack = 1e-6 * w.abs().max()  # fp32 rounding of q * s (+ min)
    for group in (None, 32):
        q, s = quantize_int8_rtn(w, group)
        gs = group or 256
        assert q.dtype == torch.int8 and s.shape == (96, 256 // gs) and torch.equal(s.half().float(), s)
        assert ((q.float() * s.repeat_interleave(gs, 1) - w).abs() <= s.repeat_interleave(gs, 1) / 2 + slack).all()
    for group in (32, 64, 128):
        q, s, mn = quantize_int4_rtn(w, group)
        assert q.max() <= 15 and s.shape == mn.shape == (96, 256 // group)
        assert torch.equal(s.half().float(), s) and torch.equal(mn.half().float(), mn)
        step = s.repeat_interleave(group, 1)
        assert ((q.float() * step + mn.repeat_interleave(group, 1) - w).abs() <= step / 2 + slack).all()
    lin = nn.Linear(256, 96, bias=False)
    lin.weight.data.copy_(w)
    for m in (Int8Linear.from_float(lin), Int4Linear.from_float(lin, 64)):
        m.finalize(True)
        assert all(t.dtype == torch.float16 for name, t in m.named_buffers() if name != "qweight")
    lin.weight.data[0, 0] = 1e7  # a scale past fp16's range stays fp32, exact
    big = Int8Linear.from_float(lin)
    big.finalize(True)
    assert big.scales.dtype == torch.float32 and big.scales[0, 0, 0] == 1e7 / 127


def test_group_size_stated_per_layer():
    assert int4_group_size(2048) == 128 and int4_group_size(576) == 64 and int4_group_size(96) == 32
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        int4_group_size(100)
    with pytest.raises(ValueError, match="group_size 128 does not divide in_features 576"):
        Int4Linear(576, 64, group_size=128)


@pytest.mark.parametrize("kind,group,fp32_scales", [("int4", 32, False), ("int4", 128, True), ("int8", None, False),
                                                    ("int8", 32, True), ("int8min", 32, False), ("int8min", 64, True),
                                                    ("int8min", 16, True)])
def test_c_dequantize_has_the_pytorch_dequantize_bits(kind, group, fp32_scales):
    m = _module(kind, group, fp32_scales=fp32_scales)
    for dtype in (torch.float32, torch.bfloat16):
        got = quant_kernel.dequantize(m.qweight, m.scales, m._mins(), 200, 256, m.group_size, dtype)
        assert got.dtype == dtype and torch.equal(_bits(got), _bits(m.dequantize(dtype)))
        ws = quant_kernel.dequantize(m.qweight, m.scales, m._mins(), 200, 256, m.group_size, dtype,
                                     out=dense_workspace(200, 256, dtype))
        assert torch.equal(_bits(ws), _bits(got))


@pytest.mark.parametrize("kind,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_kernel_reference(kind, group, dtype):
    for fp32_scales in (False, True):
        m = _module(kind, group, fp32_scales=fp32_scales)
        for rows in (1, 3, 4, 9, 60):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
            got, want = m(x), m.kernel_reference(x)
            assert got.dtype == dtype and got.shape == (rows, 200)
            if dtype == torch.float32:
                rel = ((got - want).abs().max() / want.abs().max()).item()
                assert rel <= KERNEL_FP32_REL, (rows, rel)
            else:  # 60 rows in bf16 is the dense path: bit-equal to the reference
                torch.testing.assert_close(got.float(), want.float(), rtol=BF16_RTOL if rows <= 48 else 0,
                                           atol=1e-6 * want.float().abs().max().item() if rows <= 48 else 0)
        x32 = x.float()  # the bias is added to the fp32 sums, once
        no_bias = quant_kernel.quant_matmul(x32, m.qweight, m.scales, m._mins(), 200, m.group_size, None)
        assert m.bias.abs().min() > 0 and torch.equal(no_bias + m._bias_f32, m(x32))


def _variants() -> dict[str, tuple[list[str], frozenset[str], str]]:
    """``{name: (compiler flags beyond the base, CPU flags it needs, quant_gemm_isa())}``."""
    v3, v4 = X86_64_V3, X86_64_V3 | X86_64_V4
    return {"plain C": ([], frozenset(), "scalar"),
            "x86-64-v3": (["-march=x86-64-v3"], v3, "avx2"),
            "x86-64-v3 + AVX-VNNI": (["-march=x86-64-v3", "-mavxvnni"], v3 | {"avx_vnni"}, "avx2+avxvnni"),
            "x86-64-v4": (["-march=x86-64-v4"], v4, "avx2"),
            "x86-64-v4 + AVX512-VNNI": (["-march=x86-64-v4", "-mavx512vnni"], v4 | {"avx512_vnni"}, "avx512vnni")}


@pytest.mark.parametrize("variant", list(_variants()))
def test_every_isa_variant_has_the_plain_c_bits(variant):
    extra, needs, want_isa = _variants()[variant]
    cpu = hardware.cpu_features()
    have = cpu.flags | {f.replace("vnni", "_vnni") for f in cpu.flags if f in ("avxvnni", "avx512vnni")}
    if extra and not cpu.x86:
        pytest.skip(f"{variant} is an x86 variant; this CPU is {cpu.machine}")
    if not needs <= have:
        pytest.skip(f"this CPU (cpu_features, {hardware.FLAGS_ENV} honoured) lacks {sorted(needs - have)} "
                    f"for {variant}")
    base = [*cbuild.BASE_FLAGS, "-ffp-contract=off"]
    plain, lib = quant_kernel.load_variant(base), quant_kernel.load_variant(base + extra)
    assert plain is not None and lib is not None, "a C compiler is here: every variant must build"
    assert quant_kernel.isa(lib) == want_isa and quant_kernel.isa(plain) == "scalar"
    for kind, group, fp32_scales in [("int4", 32, False), ("int4", 128, True), ("int8", None, False),
                                     ("int8", 32, True), ("int8min", 32, False), ("int8min", 64, True),
                                     ("int8", 16, False), ("int8min", 16, True)]:
        m = _module(kind, group, fp32_scales=fp32_scales)
        for rows in (1, 3, 4, 5, 9):  # every remainder of 4- and 2-row blocks
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
                x[-1, 70] = float("nan") if rows > 1 else x[-1, 70]
                a, b = (quant_kernel.quant_matmul(x, m.qweight, m.scales, m._mins(), 200, m.group_size,
                                                  m._bias_f32, lib=v) for v in (lib, plain))
                assert torch.equal(_bits(a), _bits(b)), (kind, group, rows, dtype)
        for dtype in (torch.float32, torch.bfloat16):
            a, b = (quant_kernel.dequantize(m.qweight, m.scales, m._mins(), 200, 256, m.group_size, dtype, lib=v)
                    for v in (lib, plain))
            assert torch.equal(_bits(a), _bits(b))


def test_default_build_is_the_best_variant_this_cpu_runs():
    cpu = hardware.cpu_features()
    f = cpu.flags
    want = "scalar"
    if cpu.x86 and X86_64_V3 <= f:
        want = "avx2+avxvnni" if {"avx_vnni", "avxvnni"} & f else "avx2"
        if X86_64_V4 <= f and {"avx512_vnni", "avx512vnni"} & f:
            want = "avx512vnni"
    assert quant_kernel.isa() == want, cpu.describe()


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_or_inf_in_a_block_gives_nan_for_that_row_only(kind, dtype):
    m = _module(kind, 32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    x[1, 40], x[3, 255] = float("nan"), float("-inf")
    out = m(x.to(dtype))
    assert out[[1, 3]].isnan().all() and out[[0, 2, 4]].isfinite().all()
    assert torch.equal(_bits(out[[0, 2, 4]]), _bits(m(x[[0, 2, 4]].to(dtype))))  # rows are independent
    assert m.kernel_reference(x.to(dtype))[[1, 3]].isnan().all()


def test_model_to_bf16_keeps_scale_dtypes_and_values():
    model = nn.Sequential(_module("int4", 32), _module("int4", 128, fp32_scales=True), _module("int8", None))
    before = {name: t.clone() for name, t in model.named_buffers()}
    model.to(torch.bfloat16)
    for name, t in model.named_buffers():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    assert model[0].scales.dtype == model[0].mins.dtype == torch.float16 and model[1].mins.dtype == torch.float32
    assert all(m.bias.dtype == torch.bfloat16 for m in model)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_bf16_above_kernel_max_rows_is_the_reference_bit_for_bit(kind):
    m = _module(kind, 64 if kind == "int4" else None)
    limit = KERNEL_MAX_ROWS[torch.bfloat16]
    g = torch.Generator().manual_seed(4)
    for shape in [(limit + 1, 256), (100, 256), (2, 30, 256)]:
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        assert torch.equal(_bits(m(x)), _bits(m.forward_reference(x))), shape
    x = torch.randn(limit, 256, generator=g).to(torch.bfloat16)  # at the limit: still the kernel
    kernel = quant_kernel.quant_matmul(x, m.qweight, m.scales, m._mins(), 200, m.group_size, m._bias_f32)
    assert torch.equal(_bits(m(x)), _bits(kernel)) and not torch.equal(kernel, m.forward_reference(x))


def test_quant_embedding_rows_equal_dequantized_table():
    table = Int8Linear.from_float(nn.Linear(64, 300, bias=False), 32)
    emb = QuantEmbedding(table)
    ids = torch.tensor([0, 5, 299, 5])
    for use_kernel in (False, True):
        table.finalize(use_kernel)
        torch.testing.assert_close(emb(ids), table.dequantize()[ids], atol=0, rtol=0)


def test_kernel_switch_follows_device_build_and_sizes(monkeypatch):
    assert quant_kernel_available("cpu") is (cbuild.compiler() is not None)
    assert quant_kernel_available("cuda") is False and quant_kernel_available(torch.device("cuda", 0)) is False
    odd = Int8Linear.from_float(nn.Linear(40, 24))  # K = 40: not blocks of 32, the reference path
    odd.finalize(True)
    x = torch.randn(3, 40)
    assert not odd.use_kernel and torch.equal(odd(x), odd.forward_reference(x))
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        quant_kernel.quant_matmul(x, odd.qweight, odd.scales, None, 24, 40)
    monkeypatch.setattr(quant_kernel, "_library", lambda: None)  # no compiler (the cached build bypassed)
    assert quant_kernel_available("cpu") is False and not quant_kernel.available() and quant_kernel.isa() is None
    with pytest.raises(RuntimeError, match="not available"):
        quant_kernel.quant_matmul(x, odd.qweight, odd.scales, None, 24, 40)


def test_int8_dot_flags_for_faked_cpus():
    def cpu(flags: str) -> CpuFeatures:
        return CpuFeatures(frozenset(flags.split()), "x86_64")

    avx2 = "avx avx2 fma f16c"
    avx512 = avx2 + " avx512f avx512bw avx512cd avx512dq avx512vl"
    assert cpu(avx2).int8_dot_flags == []
    assert cpu(avx2 + " avx512_vnni").int8_dot_flags == []  # VNNI without x86-64-v4: not used
    assert cpu(avx512).int8_dot_flags == []
    assert cpu(avx512 + " avx512_vnni").int8_dot_flags == ["-mavx512vnni"]
    assert cpu(avx2 + " avx_vnni").int8_dot_flags == ["-mavxvnni"]
    assert cpu("sse2 avx_vnni").int8_dot_flags == []  # no -march to add it to
    assert CpuFeatures(frozenset({"asimd", "bf16"}), "aarch64").int8_dot_flags == []
    flags = quant_kernel.compile_flags(cpu(avx2 + " avx_vnni"))
    assert flags[-2:] == ["-march=x86-64-v3", "-mavxvnni"] and "-ffp-contract=off" in flags
