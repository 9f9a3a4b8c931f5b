"""What this machine's CPU can run: its instruction-set features, detected once, and the fast
paths they allow.

Three fast paths depend on the CPU, and each asks this module (never ``/proc/cpuinfo`` or
torch directly), so one place decides and a test fakes a CPU by monkeypatching
``cpu_features``:

- ``dtype="auto"`` picks bf16 only where the CPU has native bf16 dot products
  (``CpuFeatures.fast_bf16``: AMX-BF16 or AVX512-BF16); elsewhere bf16 is emulated through
  fp32 and slower than fp32.
- bf16 linear layers over oneDNN-packed weights (``layers/linear.py``) need oneDNN's bf16
  path, which PyTorch allows only where ``mkldnn_bf16_device_check`` passes
  (``aten/src/ATen/native/mkldnn/Utils.h``): x86 with AVX512-BW + VL + DQ or AVX-NE-CONVERT,
  aarch64 with BF16 (``CpuFeatures.onednn_bf16``). Elsewhere ``nn.Linear`` stays, same bits.
- the C kernels (decode attention, quantized matmul) are compiled for ``-march=x86-64-v4``
  (AVX-512 F/BW/CD/DQ/VL) or ``x86-64-v3`` (AVX2 + FMA + F16C) where the CPU has them, else
  for the compiler's default target (``CpuFeatures.kernel_march``); the quantized matmul adds
  AVX512-VNNI / AVX-VNNI where present (``CpuFeatures.int8_dot_flags``).

``ATLAS_VLM_CPU_FLAGS`` (flags separated by spaces or commas, cpuinfo spelling, e.g.
``"avx avx2 fma f16c"``) replaces the detected flags for the whole process: a machine with
more instructions then takes exactly the paths a smaller CPU would (``.ci/run`` runs the
CPU-path tests as an AVX2-only machine this way).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field

import torch

__all__ = ["CpuFeatures", "cpu_features", "cpuinfo_flags", "default_num_threads", "usable_cpus", "FLAGS_ENV"]

FLAGS_ENV = "ATLAS_VLM_CPU_FLAGS"
X86_64_V3 = frozenset({"avx", "avx2", "fma", "f16c"})
X86_64_V4 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
ONEDNN_BF16_AVX512 = frozenset({"avx512bw", "avx512vl", "avx512dq"})
NATIVE_BF16 = ("amx_bf16", "avx512_bf16")  # x86 flags with native bf16 dot products


@dataclass(frozen=True)
class CpuFeatures:
    """A CPU's instruction-set flags (Linux ``/proc/cpuinfo`` spelling: ``avx2``, ``avx512bw``,
    ``avx512_bf16``, ``amx_bf16``; aarch64 ``Features``: ``asimd``, ``bf16``) and the fast
    paths they allow.

    Attributes:
        flags: the flags.
        machine: ``platform.machine()`` (``x86_64``, ``aarch64``, ...).
    """

    flags: frozenset[str] = field(default_factory=frozenset)
    machine: str = field(default_factory=platform.machine)

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i386", "i686")

    @property
    def fast_bf16(self) -> bool:
        """Native bf16 matmuls (AMX-BF16 or AVX512-BF16 on x86): what ``dtype="auto"`` needs to pick bf16."""
        return self.x86 and any(f in self.flags for f in NATIVE_BF16)

    @property
    def onednn_bf16(self) -> bool:
        """PyTorch's ``mkldnn_bf16_device_check``: oneDNN-packed bf16 linears can run."""
        if self.x86:
            return ONEDNN_BF16_AVX512 <= self.flags or "avx_ne_convert" in self.flags or "amx_bf16" in self.flags
        return self.machine.lower() in ("aarch64", "arm64") and "bf16" in self.flags

    @property
    def kernel_march(self) -> str | None:
        """``-march`` for the C decode kernel, or None (the compiler's default target)."""
        if not self.x86:
            return None
        if X86_64_V4 <= self.flags:
            return "x86-64-v4"
        if X86_64_V3 <= self.flags:
            return "x86-64-v3"
        return None

    @property
    def int8_dot_flags(self) -> list[str]:
        """Compiler flags for the int8 dot-product instructions the quantized matmul kernel
        uses beyond ``kernel_march``: ``-mavx512vnni`` (AVX512-VNNI, with ``x86-64-v4``),
        ``-mavxvnni`` (AVX-VNNI, the VEX form on AVX2 CPUs such as Alder Lake); none elsewhere."""
        march, out = self.kernel_march, []
        if march == "x86-64-v4" and {"avx512_vnni", "avx512vnni"} & self.flags:
            out.append("-mavx512vnni")
        if march is not None and {"avx_vnni", "avxvnni"} & self.flags:
            out.append("-mavxvnni")
        return out

    def describe(self) -> str:
        """One line for logs: the machine and the paths taken, e.g.
        ``x86_64, AVX-512 with BF16: auto dtype bf16, packed bf16 linears, kernel x86-64-v4``."""
        if self.x86:
            isa = ("AVX-512" if "avx512f" in self.flags else "AVX2" if "avx2" in self.flags else "no AVX2")
            if self.fast_bf16:
                isa += " with " + ("AMX-BF16" if "amx_bf16" in self.flags else "BF16")
        else:
            isa = "BF16" if "bf16" in self.flags else "no BF16"
        return (f"{self.machine}, {isa}: auto dtype {'bf16' if self.fast_bf16 else 'fp32'}, "
                f"{'packed' if self.onednn_bf16 else 'plain'} bf16 linears, "
                f"kernel {self.kernel_march or 'default target'}")


def cpuinfo_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first ``flags`` (x86) or ``Features`` (aarch64) line of Linux's ``cpuinfo``; empty
    where the file is missing or has neither."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features") and ":" in line:
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _torch_flags() -> set[str]:
    """``torch.cpu.get_capabilities()`` (torch >= 2.8) in cpuinfo spelling (``avx512_bw`` ->
    ``avx512bw``; both spellings kept); empty on an older torch."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return set()
    out = set()
    for name, value in get().items():
        if value is True:
            out.add(name)
            if name.startswith("avx512_"):
                out.add("avx512" + name[len("avx512_"):])
    return out


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's ``CpuFeatures``, detected once: ``$ATLAS_VLM_CPU_FLAGS`` if set, else the
    union of torch's cpuinfo-based capabilities and ``/proc/cpuinfo``'s flags."""
    override = os.environ.get(FLAGS_ENV)
    if override is not None:
        return CpuFeatures(frozenset(override.replace(",", " ").split()))
    return CpuFeatures(frozenset(_torch_flags() | cpuinfo_flags()))


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may really run on: its affinity mask, capped by a cgroup CPU quota
    (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; e.g. ``docker --cpus``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = None
    try:
        with open(os.path.join(cgroup_root, "cpu.max")) as f:
            q, period = f.read().split()[:2]
            if q != "max":
                quota = int(q) / int(period)
    except (OSError, ValueError):
        try:
            with open(os.path.join(cgroup_root, "cpu", "cpu.cfs_quota_us")) as f:
                q = int(f.read())
            with open(os.path.join(cgroup_root, "cpu", "cpu.cfs_period_us")) as f:
                period = int(f.read())
            quota = q / period if q > 0 else None
        except (OSError, ValueError):
            pass
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def default_num_threads(cpus: int | None = None) -> int:
    """Threads for torch when neither ``OMP_NUM_THREADS`` nor ``EngineConfig.num_threads`` says:
    the CPUs this process may run on (:func:`usable_cpus`: its affinity mask, capped by a cgroup
    quota), as llama.cpp does. Not the load average: a value read once at start kept a server
    started beside a briefly busy process at 1 of 2 threads for its whole life. OpenMP's
    threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, set by ``atlas_vlm/__init__``), so a
    core busy with other work is shared, not spun on."""
    return max(1, usable_cpus() if cpus is None else cpus)


_threads_chosen = False


def apply_num_threads(num_threads: int | None) -> int:
    """Set torch's CPU threads for an engine: ``num_threads`` if given; else, where
    ``OMP_NUM_THREADS`` is unset, ``default_num_threads()`` (once per process). Returns the
    threads in use."""
    global _threads_chosen
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif "OMP_NUM_THREADS" not in os.environ and not _threads_chosen:
        torch.set_num_threads(default_num_threads())
        _threads_chosen = True
    return torch.get_num_threads()
