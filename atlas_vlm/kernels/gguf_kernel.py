"""Matmuls on GGUF tensors as stored (``csrc/gguf_gemm.c``): ``y = x @ W^T`` with ``W`` the
file's own rows of ggml blocks (Q4_K, Q5_K, Q6_K, Q8_0), read in place from the mapped file:
no conversion, no copy. After ik_llama.cpp's ``iqk_gemm_kquants.cpp``: the activations are
quantized once per call to q8_K (an fp32 scale per 256, int8 values, int16 sums per 16), every
super-block's integer dot products are exact (scales in int32, Q4_K / Q5_K mins and Q6_K's
-32 through the activation sums), one fp32 multiply-add per 256 values and row; up to 8
activation rows share one unpacking of each weight block.

Variants by ``hardware.cpu_features()`` (``ATLAS_VLM_CPU_FLAGS`` fakes a CPU): AVX512-VNNI
(``vpdpbusd`` + ``vpdpwssd``), AVX2 (``vpmaddubsw`` + ``vpmaddwd``), plain C: the same integers,
fp32 sums in a different order (tests bound the difference). Without a C compiler
:func:`gguf_matmul` is :func:`gguf_matmul_reference` (dequantize, then ``F.linear``).

The fast path (:func:`repack` once, then :func:`gguf_matmul_packed`): Q4_K, Q6_K and Q8_0 rows
interleaved 16 at a time (after ik_llama.cpp's ``_r4`` layouts), so one 512-bit ``vpdpbusd``
holds 4 values of each of 16 output rows; every variant gives the same bits there.

The activation quantization makes the kernel approximate against the fp32 reference (each
value rounded to one of 255 levels of its 256-block's max: ``docs/quantization.md`` states the bound
the tests hold); against the same product with the activations quantized the same way it is
exact up to fp32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from atlas_vlm import hardware
from atlas_vlm.kernels import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gguf_gemm.c"
QK_K = 256  # values per super-block and per activation scale, as the C source
MAX_ROWS = 8  # activation rows per weight read, as the C source
# GGUF type name -> (ggml_type id, values per block, bytes per block)
TYPES = {"Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
PACKED_TYPES = ("Q4_K", "Q6_K", "Q8_0")  # types with a 16-row interleaved kernel (csrc/gguf_repack.h)
PACK_ROWS = 16  # rows per interleaved group, as the C source


def compile_flags(cpu: hardware.CpuFeatures | None = None) -> list[str]:
    """Compiler flags for ``cpu`` (default this machine's): ``-march`` from ``kernel_march``
    plus ``int8_dot_flags`` (``-mavx512vnni`` selects the AVX512-VNNI variant)."""
    cpu = cpu or hardware.cpu_features()
    return cbuild.cpu_flags(cpu=cpu) + cpu.int8_dot_flags


def load_variant(flags: list[str]) -> ctypes.CDLL | None:
    """The kernel built with ``flags`` (cached), its functions typed; None when it cannot be
    built (logged). Tests build every variant this CPU runs and compare them."""
    lib = cbuild.load(SOURCE, flags, [([], ["-lm"])], "GGUF matmuls use the dequantized reference")
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gguf_gemm.argtypes = [p, i64, i64, p, i32, i64, p, i32]
    lib.gguf_gemm.restype = ctypes.c_int
    lib.gguf_gemm_isa.restype = ctypes.c_char_p
    lib.gguf_packed_bytes.argtypes = [i32, i64, i64]
    lib.gguf_packed_bytes.restype = i64
    lib.gguf_repack.argtypes = [p, i32, i64, i64, p, i32]
    lib.gguf_repack.restype = ctypes.c_int
    lib.gguf_gemm_packed.argtypes = [p, i64, i64, p, i32, i64, p, p, i32]
    lib.gguf_gemm_packed.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_variant(compile_flags())


def available() -> bool:
    """Whether the kernel is built and loaded for this machine (builds it on the first call)."""
    return _library() is not None


def isa(lib: ctypes.CDLL | None = None) -> str | None:
    """The variant: ``"avx512vnni"``, ``"avx2"`` or ``"scalar"``; None without a kernel."""
    lib = lib or _library()
    return None if lib is None else lib.gguf_gemm_isa().decode()


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one stored row of ``in_features`` values of GGUF type ``qtype``.

    Raises:
        ValueError: a type the kernel does not run, or ``in_features`` not a multiple of 256.
    """
    if qtype not in TYPES:
        raise ValueError(f"GGUF type {qtype!r} has no stored-block kernel; supported: {sorted(TYPES)}")
    if in_features < QK_K or in_features % QK_K:
        raise ValueError(f"in_features {in_features} is not a multiple of {QK_K} (q8_K activations need whole "
                         f"super-blocks)")
    _, per_block, nbytes = TYPES[qtype]
    return in_features // per_block * nbytes


def _check(x: torch.Tensor, blocks: torch.Tensor, qtype: str, out_features: int, in_features: int) -> None:
    want = (out_features, row_bytes(qtype, in_features))
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
        raise ValueError(f"blocks for a [{out_features}, {in_features}] {qtype} weight must be uint8 {list(want)}, "
                         f"got {blocks.dtype} {list(blocks.shape)}")
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be fp32 or bf16 [M, {in_features}], got {x.dtype} {list(x.shape)}")


def gguf_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str, out_features: int,
                          in_features: int) -> torch.Tensor:
    """``x @ W^T`` with ``W`` dequantized by ``gguf.quants.dequantize`` (fp32), then ``F.linear``
    in fp32; arguments and result as :func:`gguf_matmul`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    _check(x, blocks, qtype, out_features, in_features)
    w = dequantize(blocks.contiguous().numpy(), GGMLQuantizationType[qtype])  # [N, K] fp32
    return F.linear(x.float(), torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))).to(x.dtype)


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, out_features: int, in_features: int,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``y[m, n] = sum_k x[m, k] * W[n, k]`` on the stored blocks.

    Args:
        x: ``[M, K]`` fp32 or bf16 on CPU.
        blocks: uint8 ``[N, bytes per row]``, the file's bytes (e.g. ``torch.from_numpy(
            reader.tensors[i].data)``: zero-copy); rows contiguous.
        qtype: ``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"`` or ``"Q8_0"``.
        out_features, in_features: ``N`` and ``K`` (``K`` a multiple of 256).
        lib: a kernel variant (tests); default this machine's, or the reference without one.

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        ValueError: a type, shape or dtype the kernel does not take (named).
        RuntimeError: the kernel refused the call (out of memory).
    """
    _check(x, blocks, qtype, out_features, in_features)
    lib = lib or _library()
    if lib is None:
        return gguf_matmul_reference(x, blocks, qtype, out_features, in_features)
    m = x.shape[0]
    out = torch.empty(m, out_features, dtype=torch.float32)
    if m == 0:
        return out.to(x.dtype)
    xf = x.float().contiguous()  # [M, K] fp32: the kernel quantizes it to q8_K
    w = blocks if blocks.is_contiguous() else blocks.contiguous()
    status = lib.gguf_gemm(xf.data_ptr(), m, in_features, w.data_ptr(), TYPES[qtype][0], out_features,
                           out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"GGUF matmul kernel refused x {list(x.shape)} against a [{out_features}, {in_features}] "
                           f"{qtype} weight (out of memory?)")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def repack(blocks: torch.Tensor, qtype: str, out_features: int, in_features: int,
           lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """The stored rows interleaved 16 at a time for :func:`gguf_matmul_packed` (layout:
    ``csrc/gguf_repack.h``; the last group zero-padded), a new uint8 tensor in anonymous memory
    (Q4_K 148 bytes a row per 256 values against 144 stored, Q6_K 210 as stored); None where
    ``qtype`` has no interleaved kernel or there is no C kernel.

    Raises:
        ValueError: ``blocks`` not ``[out_features, bytes per row]`` uint8 of ``qtype``.
    """
    _check(torch.empty(0, in_features), blocks, qtype, out_features, in_features)
    lib = lib or _library()
    if lib is None or qtype not in PACKED_TYPES:
        return None
    tid = TYPES[qtype][0]
    packed = torch.empty(lib.gguf_packed_bytes(tid, out_features, in_features), dtype=torch.uint8)
    w = blocks if blocks.is_contiguous() else blocks.contiguous()
    if lib.gguf_repack(w.data_ptr(), tid, out_features, in_features, packed.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"cannot repack a [{out_features}, {in_features}] {qtype} weight")
    return packed


def gguf_matmul_packed(x: torch.Tensor, packed: torch.Tensor, qtype: str, out_features: int, in_features: int,
                       lib: ctypes.CDLL | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gguf_matmul` on :func:`repack`'s output (made by the same ``lib``): the same
    integers per output (q8_K activations, exact int32 dot products), one fp32 multiply-add per
    256 values, summed over super-blocks in order: every variant gives the same bits. ``bias``
    (``[N]``, any float dtype, taken as fp32) is added in fp32 before the result is rounded
    to ``x``'s dtype (the one-call decode step does the same).

    Raises:
        ValueError: ``x`` not fp32 / bf16 ``[M, in_features]``, or ``packed`` not the size
            :func:`repack` makes; RuntimeError: no C kernel, or it refused (out of memory).
    """
    if x.dim() != 2 or x.shape[1] != in_features or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be fp32 or bf16 [M, {in_features}], got {x.dtype} {list(x.shape)}")
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("gguf_matmul_packed needs the C kernel (repack returned None without one)")
    tid = TYPES[qtype][0] if qtype in PACKED_TYPES else -1
    want = lib.gguf_packed_bytes(tid, out_features, in_features)
    if want == 0 or packed.dtype != torch.uint8 or packed.numel() != want or not packed.is_contiguous():
        raise ValueError(f"packed must be repack()'s {want} contiguous uint8 bytes for a [{out_features}, "
                         f"{in_features}] {qtype} weight, got {packed.dtype} {packed.numel()}")
    m = x.shape[0]
    out = torch.empty(m, out_features, dtype=torch.float32)
    if m == 0:
        return out.to(x.dtype)
    xf = x.float().contiguous()  # [M, K] fp32: the kernel quantizes it to q8_K
    b = None if bias is None else bias.float().contiguous()
    if b is not None and tuple(b.shape) != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {list(b.shape)}")
    if lib.gguf_gemm_packed(xf.data_ptr(), m, in_features, packed.data_ptr(), tid, out_features,
                            None if b is None else b.data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise RuntimeError(f"GGUF packed kernel refused x {list(x.shape)} (out of memory?)")
    return out if x.dtype == torch.float32 else out.to(x.dtype)
