"""CPU capability detection (``atlas_vlm.hardware``) and the fast paths it picks, on faked
CPUs of every kind seen (AMX, AVX512-BF16, AVX-512 without BF16, AVX2 only, aarch64 with and
without BF16): ``dtype="auto"`` (bf16 only with native bf16 dot products), oneDNN-packed bf16
linears (PyTorch's ``mkldnn_bf16_device_check``), the decode kernel's ``-march``. The engine on
a faked AVX2-only CPU is in ``tests/parity/test_packed_linear.py``."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm import EngineConfig, hardware
from atlas_vlm.hardware import CpuFeatures
from atlas_vlm.kernels import decode_kernel
from atlas_vlm.layers.linear import can_pack

pytestmark = pytest.mark.text

AVX2 = "fpu sse2 avx avx2 fma f16c"
AVX512 = AVX2 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni"
CPUS = {  # name: (machine, flags, auto dtype bf16, oneDNN bf16 packing, kernel -march)
    "sapphire_rapids_amx": ("x86_64", AVX512 + " avx512_bf16 amx_tile amx_bf16 amx_int8", True, True, "x86-64-v4"),
    "zen4_avx512_bf16": ("x86_64", AVX512 + " avx512_bf16", True, True, "x86-64-v4"),
    "skylake_avx512": ("x86_64", AVX512, False, True, "x86-64-v4"),
    "epyc_avx2_only": ("x86_64", AVX2, False, False, "x86-64-v3"),
    "arrow_lake_avx_ne_convert": ("x86_64", AVX2 + " avx_vnni avx_ne_convert", False, True, "x86-64-v3"),
    "old_x86_sse": ("x86_64", "fpu sse sse2 sse4_2", False, False, None),
    "graviton3_bf16": ("aarch64", "fp asimd sve bf16 i8mm", False, True, None),
    "graviton2": ("aarch64", "fp asimd", False, False, None),
}


@pytest.mark.parametrize("name", sorted(CPUS))
def test_fast_paths_follow_the_cpu(monkeypatch, name):
    machine, flags, bf16, packs, march = CPUS[name]
    cpu = CpuFeatures(frozenset(flags.split()), machine)
    assert (cpu.fast_bf16, cpu.onednn_bf16, cpu.kernel_march) == (bf16, packs, march)
    monkeypatch.setattr(hardware, "cpu_features", lambda: cpu)
    assert EngineConfig(model="unused", device="cpu").torch_dtype() == (torch.bfloat16 if bf16 else torch.float32)
    assert EngineConfig(model="unused", device="cpu", dtype="float32").torch_dtype() == torch.float32
    assert EngineConfig(model="unused", device="cpu", dtype="bfloat16").torch_dtype() == torch.bfloat16
    assert can_pack(torch.bfloat16, "cpu") == (packs and torch.backends.mkldnn.is_available())
    assert not can_pack(torch.float32, "cpu") and not can_pack(torch.bfloat16, "cuda")
    assert [f for f in decode_kernel._compile_flags() if f.startswith("-march")] == ([f"-march={march}"] if march else [])
    assert cpu.describe().startswith(machine)


@pytest.mark.parametrize("flags, machine, expected", [
    ("fpu avx2 fma f16c avx", "x86_64", "x86_64, AVX2: auto dtype fp32, plain bf16 linears, kernel x86-64-v3"),
    (AVX512 + " avx512_bf16", "x86_64", "x86_64, AVX-512 with BF16: auto dtype bf16, packed bf16 linears, kernel x86-64-v4"),
    ("fp asimd bf16", "aarch64", "aarch64, BF16: auto dtype fp32, packed bf16 linears, kernel default target"),
])
def test_describe_names_the_paths(flags, machine, expected):
    assert CpuFeatures(frozenset(flags.split()), machine).describe() == expected


def test_env_override_replaces_detection(monkeypatch):
    monkeypatch.setenv(hardware.FLAGS_ENV, "avx,avx2 fma f16c")
    hardware.cpu_features.cache_clear()
    try:
        cpu = hardware.cpu_features()
        assert cpu.flags == {"avx", "avx2", "fma", "f16c"}
        assert (cpu.fast_bf16, cpu.onednn_bf16) == (False, False)
    finally:
        monkeypatch.delenv(hardware.FLAGS_ENV)
        hardware.cpu_features.cache_clear()


@pytest.mark.parametrize("text, expected", [
    ("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t: other\n", {"fpu", "avx2", "avx512_bf16"}),
    ("processor\t: 0\nFeatures\t: fp asimd bf16\n", {"fp", "asimd", "bf16"}),  # aarch64 spelling
    ("processor\t: 0\nmodel name\t: test\n", set()),
])
def test_cpuinfo_flags(tmp_path, text, expected):
    (tmp_path / "cpuinfo").write_text(text)
    assert hardware.cpuinfo_flags(str(tmp_path / "cpuinfo")) == expected
    assert hardware.cpuinfo_flags(str(tmp_path / "absent")) == set()


def test_torch_capabilities_in_cpuinfo_spelling(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bw": True, "avx512_bf16": True,
                                                                 "amx_bf16": False, "avx2": True})
    flags = hardware._torch_flags()
    assert {"avx512bw", "avx512_bw", "avx512_bf16", "avx2"} <= flags and "amx_bf16" not in flags
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert hardware._torch_flags() == set()


def test_detection_on_this_machine_agrees_with_proc_cpuinfo():
    """Unless overridden, the detected flags include /proc/cpuinfo's, and torch's own oneDNN
    bf16 check agrees with ``onednn_bf16``."""
    if hardware.FLAGS_ENV in __import__("os").environ:
        pytest.skip(f"{hardware.FLAGS_ENV} overrides the detection in this run")
    cpu = hardware.cpu_features()
    assert hardware.cpuinfo_flags() <= cpu.flags
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None and cpu.x86:
        assert check() == cpu.onednn_bf16


@pytest.mark.parametrize("cpu_max, expected", [("max 100000", 4), ("150000 100000", 1), ("200000 100000", 2),
                                               ("800000 100000", 4)])
def test_usable_cpus_follow_the_cgroup_quota(monkeypatch, tmp_path, cpu_max, expected):
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert hardware.usable_cpus(str(tmp_path)) == expected
    assert hardware.usable_cpus(str(tmp_path / "absent")) == 4  # no cgroup: the affinity mask


def test_engine_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert hardware.apply_num_threads(1) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(2 if before > 1 else 1)
        assert hardware.apply_num_threads(None) == torch.get_num_threads()  # the user's OMP_NUM_THREADS stands
        with pytest.raises(ValueError, match="num_threads must be an int >= 1"):
            EngineConfig(model="unused", num_threads=0)
    finally:
        torch.set_num_threads(before)
