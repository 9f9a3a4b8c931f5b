"""Quantized linear modules (``atlas_vlm.layers.quant_linear``): packing equals PyTorch's
op, round-to-nearest error within half a step, the kernel path equals the dequantized
reference up to bf16 rounding, and the kernel choice follows the detected capability
(faked both ways)."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm import hardware
from atlas_vlm.hardware import CpuFeatures
from torch import nn

from atlas_vlm.layers.quant_linear import (Int4Linear, Int8Linear, QuantEmbedding, int4_group_size, pack_int4_cpu,
                                           pack_int4_plain, quant_kernel_available, quantize_int4_rtn,
                                           quantize_int8_rtn, unpack_int4_cpu, unpack_int4_plain)

pytestmark = pytest.mark.text

KERNEL_REL_BOUND = 2e-2  # kernel vs reference: max |diff| / max |reference| (measured <= 9.1e-3)


ATEN_AVX512 = torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")
needs_aten_avx512 = pytest.mark.skipif(
    not ATEN_AVX512, reason="the int4 op's packed layout checked here is ATen's AVX-512 kernel's; this process "
                            f"dispatches {torch.backends.cpu.get_cpu_capability()} (the engine then uses the reference)")


@needs_aten_avx512
def test_int4_packing_equals_pytorch_op_and_inverts():
    g = torch.Generator().manual_seed(0)
    for n, k in [(64, 64), (960, 576), (128, 1536)]:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        assert torch.equal(pack_int4_cpu(q), torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        assert torch.equal(unpack_int4_cpu(pack_int4_cpu(q)), q.to(torch.uint8))
        assert torch.equal(unpack_int4_plain(pack_int4_plain(q)), q.to(torch.uint8))


def test_round_to_nearest_error_is_at_most_half_a_step():
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    q, s = quantize_int8_rtn(w)
    err = (q.float() * s - w).abs()
    assert q.dtype == torch.int8 and s.shape == (96, 1)
    assert (err <= s / 2 + 1e-6).all()
    q4, sz = quantize_int4_rtn(w, 64)
    assert q4.max() <= 15 and sz.shape == (4, 96, 2)
    scale = sz[..., 0].t().repeat_interleave(64, 1)
    deq = (q4.float() - 8) * scale + sz[..., 1].t().repeat_interleave(64, 1)
    assert ((deq - w).abs() <= scale / 2 + 1e-5).all()
    # a module built from these tensors dequantizes to the same numbers
    m = Int4Linear(256, 96, group_size=64)
    m.load_rows(0, q4, sz)
    torch.testing.assert_close(m.dequantize(), deq, atol=1e-6, rtol=0)


def test_group_size_stated_per_layer():
    assert int4_group_size(2048) == 128 and int4_group_size(576) == 64 and int4_group_size(96) == 32
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        int4_group_size(100)
    with pytest.raises(ValueError, match="group_size 128 does not divide in_features 576"):
        Int4Linear(576, 64, group_size=128)


@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_equals_dequantized_reference(kind, group, dtype):
    if kind == "int4" and not ATEN_AVX512:
        pytest.skip(f"the int4 kernel's layout is ATen's AVX-512 one; this process dispatches "
                    f"{torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(0)
    lin = nn.Linear(256, 192, bias=True)
    cls = Int8Linear if kind == "int8" else Int4Linear
    ref, ker = cls.from_float(lin, group), cls.from_float(lin, group)
    ref.finalize(False)
    ker.finalize(True)
    assert ker.use_kernel and not ref.use_kernel
    x = torch.randn(5, 256).to(dtype)
    a, b = ker(x), ref(x)
    assert a.dtype == dtype and a.shape == (5, 192)
    bound = KERNEL_REL_BOUND * b.float().abs().max()
    assert (a.float() - b.float()).abs().max() <= bound
    # the reference is F.linear over the dequantized weight, whatever the layout
    torch.testing.assert_close(ref.dequantize(), ker.dequantize(), atol=2e-2 * ref.dequantize().abs().max().item(),
                               rtol=0)
    assert (ref(x).float() - torch.nn.functional.linear(x, ref.dequantize(dtype), lin.bias.to(dtype)).float()
            ).abs().max() == 0
    # and the quantized weight is close to the dense one (half a step; int4 coarser)
    rel = (ref.dequantize() - lin.weight).abs().max() / lin.weight.abs().max()
    assert rel < (0.01 if kind == "int8" else 0.1)


def test_int4_kernel_needs_rows_in_blocks_of_64():
    m = Int4Linear.from_float(nn.Linear(64, 96), 32)
    m.finalize(True)
    assert not m.use_kernel  # 96 rows: reference path
    x = torch.randn(2, 64)
    torch.testing.assert_close(m(x), m.forward_reference(x), atol=0, rtol=0)


def test_quant_embedding_rows_equal_dequantized_table():
    table = Int8Linear.from_float(nn.Linear(64, 300, bias=False), 32)
    emb = QuantEmbedding(table)
    ids = torch.tensor([0, 5, 299, 5])
    for use_kernel in (False, True):
        table.finalize(use_kernel)
        torch.testing.assert_close(emb(ids), table.dequantize()[ids], atol=0, rtol=0)


def test_kernel_capability_detection_faked_both_ways(monkeypatch):
    def cpu(flags):
        return CpuFeatures(frozenset(flags.split()), "x86_64")

    assert quant_kernel_available("cpu", cpu("avx2 avx512f avx512_bf16"), "AVX512") is True
    assert quant_kernel_available("cpu", cpu("avx2 amx_tile amx_bf16"), "AVX512") is True
    assert quant_kernel_available("cpu", cpu("avx avx2 fma f16c"), "AVX2") is False  # AVX2-only: reference
    assert quant_kernel_available("cpu", cpu("avx2 avx512_bf16"), "AVX2") is False  # ATen capped at AVX2: int4 layout differs
    assert quant_kernel_available("cuda", cpu("avx2 avx512_bf16"), "AVX512") is False
    monkeypatch.setattr(hardware, "cpu_features", lambda: cpu("avx avx2 fma f16c"))  # the detector itself faked
    assert quant_kernel_available("cpu", aten_capability="AVX512") is False
    monkeypatch.setattr(hardware, "cpu_features", lambda: cpu("avx2 avx512_bf16"))
    assert quant_kernel_available("cpu", aten_capability="AVX512") is True
    monkeypatch.delattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", raising=False)
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        assert quant_kernel_available("cpu", cpu("avx2 avx512_bf16"), "AVX512") is False  # an older torch without the op
