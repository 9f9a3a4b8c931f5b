"""The quantized matmul kernel (``csrc/quant_gemm.c``): int4 / int8 weights in tiles of 16
output rows against activations quantized on the fly to int8 in blocks of 32, the way
llama.cpp multiplies its GGUF blocks; and the tiles dequantized to a dense weight.

Why a kernel of our own: measured on SmolLM2-135M's shapes at one decode row (one thread,
``python -m benchmarks.quant_linear``), PyTorch's ``_weight_int4pack_mm_for_cpu`` reads
its weights at a fraction of the memory bandwidth, ``_weight_int8pack_mm`` takes one call
per group of columns for group-wise scales (GGUF Q8_0), both are unvectorised in fp32 and
the int4 layout is AVX-512 only; fbgemm's dynamic int8 linear is fast but per-channel int8
only. This kernel reads every weight byte once per call (per 4 activation rows), with exact
int32 block sums, on AVX512-VNNI, AVX2 (with AVX-VNNI where present) and plain C, all with
the same bits (the float steps are done in one order; see the C source).

Built on first use by ``kernels/cbuild.py`` with ``-march`` from
``hardware.cpu_features().kernel_march`` plus ``int8_dot_flags`` and ``-ffp-contract=off``
(the order of float steps is part of the answer). Without a compiler ``available()`` is
False and quantized linears use their dequantized reference.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from atlas_vlm import hardware
from atlas_vlm.kernels import cbuild

SOURCE = Path(__file__).with_name("csrc") / "quant_gemm.c"
TILE = 16  # output rows per tile, as the C source
QBLOCK = 32  # activation values per int8 block, as the C source


class KernelTensors(NamedTuple):
    """A quantized linear as the C kernels read it (a quantized linear's ``kernel_tensors()``,
    ``layers.quant_linear``): tiled ``qweight``, ``scales`` (fp16 or fp32), ``mins`` (None:
    symmetric), the fp32 ``bias`` (or None), ``out_features`` N, ``in_features`` K,
    ``group_size`` and whether it is int4."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    group_size: int
    int4: bool


def compile_flags(cpu: hardware.CpuFeatures | None = None, int8_dot: bool = True) -> list[str]:
    """Compiler flags for ``cpu`` (default: this machine's ``hardware.cpu_features()``);
    ``int8_dot=False`` leaves out its VNNI flags (a compiler too old to know them)."""
    cpu = cpu or hardware.cpu_features()
    return cbuild.cpu_flags("-ffp-contract=off", cpu=cpu) + (cpu.int8_dot_flags if int8_dot else [])


def load_variant(flags: list[str]) -> ctypes.CDLL | None:
    """The kernel built with ``flags`` (cached), its functions typed; None when it cannot be
    built (logged). Tests build every variant this CPU runs and compare their bits."""
    lib = cbuild.load(SOURCE, flags, [([], ["-lm"])], "quantized linears use the dequantized reference")
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_gemm_int4.argtypes = [p, i32, i64, i64, p, p, p, i32, i64, i64, p, p, i32, i32]
    lib.quant_gemm_int8.argtypes = [p, i32, i64, i64, p, p, p, i32, i64, i64, p, p, i32, i32]
    lib.quant_dequantize.argtypes = [p, p, p, i32, i64, i64, i64, i32, p, i32, i32]
    for fn in (lib.quant_gemm_int4, lib.quant_gemm_int8, lib.quant_dequantize):
        fn.restype = ctypes.c_int
    lib.quant_gemm_isa.restype = ctypes.c_char_p
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_variant(compile_flags())
    if lib is None and hardware.cpu_features().int8_dot_flags:  # the compiler may not know -mavx512vnni / -mavxvnni
        lib = load_variant(compile_flags(int8_dot=False))
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded for this machine (builds it on the first call)."""
    return _library() is not None


def isa(lib: ctypes.CDLL | None = None) -> str | None:
    """The variant compiled: ``"avx512vnni"``, ``"avx2+avxvnni"``, ``"avx2"`` or ``"scalar"``; None
    without a kernel."""
    lib = lib or _library()
    return None if lib is None else lib.quant_gemm_isa().decode()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 out_features: int, group_size: int, bias: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` stored in tiles.

    Args:
        x: ``[M, K]`` fp32 or bf16, contiguous, on CPU.
        qweight: int4: uint8 ``[T, K / 8, 16, 4]``; int8: int8 ``[T, K / 4, 16, 4]``
            (``T = ceil(out_features / 16)``; see ``quant_linear`` for the byte order).
        scales, mins: ``[T, K / group_size, 16]`` fp16 or fp32, the same dtype; ``mins`` None
            for ``W = q * scale`` (int8 only), else ``W = q * scale + min``.
        out_features: ``N`` (rows past ``N`` in the last tile are padding, not written).
        group_size: inputs per scale dividing ``K``: a multiple of 32, or 16 (GGUF Q6_K /
            Q3_K / Q2_K: each group's int32 sum over its half of an activation block).
        bias: fp32 ``[N]`` or None.
        lib: a kernel variant (tests); default this machine's.

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        RuntimeError: no kernel, or it refused the sizes (named).
    """
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("the quantized matmul kernel is not available (see the log)")
    m, k = x.shape
    out = torch.empty(m, out_features, dtype=x.dtype)
    if m == 0:  # no rows (e.g. the LM head of a prefill chunk that samples nothing)
        return out
    xb, f16, ob = int(x.dtype == torch.bfloat16), int(scales.dtype == torch.float16), int(x.dtype == torch.bfloat16)
    threads = torch.get_num_threads()
    if qweight.dtype == torch.uint8:  # int4
        if mins is None:
            raise ValueError("an int4 weight needs mins")
        status = lib.quant_gemm_int4(x.data_ptr(), xb, m, k, qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                                     f16, out_features, group_size, _ptr(bias), out.data_ptr(), ob, threads)
    else:
        status = lib.quant_gemm_int8(x.data_ptr(), xb, m, k, qweight.data_ptr(), scales.data_ptr(), _ptr(mins), f16,
                                     out_features, group_size, _ptr(bias), out.data_ptr(), ob, threads)
    if status != 0:
        raise RuntimeError(f"quantized matmul kernel refused x {tuple(x.shape)} against a [{out_features}, {k}] "
                           f"weight with group {group_size} (K a multiple of 32, the group 16 or a multiple of 32)")
    return out


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, out_features: int,
               in_features: int, group_size: int, dtype: torch.dtype, lib: ctypes.CDLL | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense ``[N, K]`` weight in ``dtype`` (fp32 or bf16): ``q * scale (+ min)`` in fp32
    (a multiply, then an add), rounded once: the same bits as ``quant_linear``'s PyTorch
    ``dequantize``. Arguments as :func:`quant_matmul`; ``out``: a contiguous ``[N, K]`` tensor
    of ``dtype`` to write into (a reused workspace: no fresh pages to fault in).

    Raises:
        RuntimeError: no kernel, or it refused the sizes.
    """
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("the quantized matmul kernel is not available (see the log)")
    if out is None:
        out = torch.empty(out_features, in_features, dtype=dtype)
    status = lib.quant_dequantize(qweight.data_ptr(), scales.data_ptr(), _ptr(mins),
                                  int(scales.dtype == torch.float16), out_features, in_features, group_size,
                                  int(qweight.dtype == torch.uint8), out.data_ptr(), int(dtype == torch.bfloat16),
                                  torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"quantized dequantize refused a [{out_features}, {in_features}] weight with group "
                           f"{group_size}")
    return out


_workspace = threading.local()


def dense_workspace(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[n, k]`` tensor of ``dtype`` from this thread's workspace (grown, never shrunk), for a
    weight dequantized for one call: reused, so its pages are not faulted in on every call."""
    buf = getattr(_workspace, "buf", {}).get(dtype)
    if buf is None or buf.numel() < n * k:
        _workspace.buf = {**getattr(_workspace, "buf", {}), dtype: torch.empty(n * k, dtype=dtype)}
        buf = _workspace.buf[dtype]
    return buf[: n * k].view(n, k)
