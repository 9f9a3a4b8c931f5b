"""``dtype="auto"`` on CPU: bf16 exactly where the CPU has AMX-BF16 or AVX512-BF16, detected
through ``torch.cpu.get_capabilities()`` (or ``/proc/cpuinfo`` flags on an older torch), fp32
elsewhere; explicit dtypes and CUDA are unaffected by the detection."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm import EngineConfig
from atlas_vlm import config as config_module
from atlas_vlm.config import cpu_has_fast_bf16

pytestmark = pytest.mark.text

NO_BF16 = {"avx2": True, "avx512_f": True, "avx512_vnni": True, "amx_tile": True, "amx_bf16": False,
           "avx512_bf16": False}


@pytest.mark.parametrize("caps, expected", [
    ({"amx_bf16": True, "amx_tile": True}, True),  # Sapphire Rapids and later
    ({"avx512_f": True, "avx512_bf16": True}, True),  # Cooper Lake, Zen 4
    (NO_BF16, False),  # AVX-512 without BF16 (Skylake-SP), AMX tiles without BF16
    ({"neon": True, "bf16": True}, False),  # ARM: not in the x86 bf16 list
    ({}, False),
])
def test_detection_from_capabilities(caps, expected):
    assert cpu_has_fast_bf16(caps) is expected


@pytest.mark.parametrize("caps, expected", [({"avx512_bf16": True}, torch.bfloat16),
                                            ({"amx_bf16": True}, torch.bfloat16),
                                            (NO_BF16, torch.float32)])
def test_auto_dtype_on_cpu_follows_detection(monkeypatch, caps, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert EngineConfig(model="unused", device="cpu").torch_dtype() == expected
    assert EngineConfig(model="unused", device="cpu", dtype="auto").torch_dtype() == expected
    assert EngineConfig(model="unused", device="cpu", dtype="float32").torch_dtype() == torch.float32
    assert EngineConfig(model="unused", device="cpu", dtype="bfloat16").torch_dtype() == torch.bfloat16


@pytest.mark.parametrize("flags, expected", [("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", True),
                                             ("fpu sse2 avx2 amx_tile amx_bf16 amx_int8", True),
                                             ("fpu sse2 avx2 avx512f avx512_vnni", False)])
def test_cpuinfo_fallback_without_torch_capabilities(monkeypatch, tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert cpu_has_fast_bf16(config_module._detected_cpu_capabilities(str(cpuinfo))) is expected


def test_missing_cpuinfo_means_fp32(monkeypatch, tmp_path):
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert cpu_has_fast_bf16(config_module._detected_cpu_capabilities(str(tmp_path / "absent"))) is False


def test_detection_on_this_machine_agrees_with_proc_cpuinfo():
    """torch's cpuinfo-based answer and the kernel's flags line name the same bf16 support."""
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    assert cpu_has_fast_bf16() is ("amx_bf16" in flags or "avx512_bf16" in flags)
