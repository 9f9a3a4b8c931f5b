"""A small C kernel for CPU decode attention straight from KV blocks (``csrc/paged_decode.c``).

One query token per request: for each (request, KV head) it reads the request's context
through its block table (no gather into a padded batch, no mask), keeps scores, softmax and
the weighted sum in fp32, and writes the output once in the cache dtype (fp32 or bf16). The
``"bucketed"`` backend's decode rows call it when it is available; everything else (prefill
chunks, CUDA) keeps PyTorch's SDPA. Tested against the reference backend
(``tests/parity/test_decode_kernel.py``).

The source is compiled on first use (``kernels/cbuild.py``): ``-O3 -fno-math-errno -fopenmp``,
``-march`` from ``hardware.cpu_features().kernel_march`` (``x86-64-v4`` where the CPU has
AVX-512 F/BW/CD/DQ/VL, ``x86-64-v3`` where it has AVX2 + FMA + F16C, else the compiler's default target: plain C, it builds for any CPU), and glibc's vector
``expf`` (libmvec) when it links. An 8-bit cache (``kv_cache_dtype`` "int8" / "fp8_e4m3")
is read by ``csrc/paged_decode_q8.c``: the same loop over codes of Hadamard-rotated K/V (q and
the output rotated once each), each token's scale applied once to its dot product and weight.
Without a compiler (or if the build fails) ``available()`` is False, the reason is logged
once, and the engine uses SDPA.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from atlas_vlm.kernels import cbuild
from mm_kv_cache_management.kv_quant import hadamard_rotate

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
SOURCE_Q8 = SOURCE.with_name("paged_decode_q8.c")
MAX_HEAD_DIM, MAX_GROUP = 256, 16  # as the C source


def _compile_flags() -> list[str]:
    return cbuild.cpu_flags()


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (once per source + flags) and load the kernel; None (logged) when impossible."""
    lib = cbuild.load(SOURCE, _compile_flags(), cbuild.LIBMVEC_ATTEMPTS, "decode attention uses SDPA")
    if lib is None:
        return None
    args = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + \
        [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@functools.cache
def _library_q8() -> ctypes.CDLL | None:
    """The 8-bit-cache kernel (built once per source + flags); None (logged) when impossible."""
    lib = cbuild.load(SOURCE_Q8, _compile_flags(), cbuild.LIBMVEC_ATTEMPTS, "8-bit KV decode attention uses SDPA")
    if lib is None:
        return None
    args = [ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + \
        [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    for name in ("paged_decode_i8_f32", "paged_decode_i8_bf16", "paged_decode_fp8_f32", "paged_decode_fp8_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.quantize_store_i8.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4
    lib.quantize_store_i8.restype = ctypes.c_int
    return lib


@functools.cache
def _code_table(kv_cache_dtype: str) -> torch.Tensor:
    """``[256]`` fp32: the value of each 8-bit code (int8: the signed byte; fp8_e4m3: its float).
    The fp8 kernels read codes through it; the int8 ones convert the byte directly."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn) if kv_cache_dtype == "fp8_e4m3" else codes.view(torch.int8)
    return values.float().contiguous()


def available(kv_cache_dtype: str = "auto") -> bool:
    """Whether the kernel for this cache format is built and loaded (builds it on the first call)."""
    return (_library() if kv_cache_dtype == "auto" else _library_q8()) is not None


def unsupported_reason(device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                       head_dim: int, kv_cache_dtype: str = "auto") -> str | None:
    """Why the kernel cannot serve a model with these sizes on ``device`` (and this
    ``kv_cache_dtype``); None when it can (builds the kernel on the first call)."""
    if torch.device(device).type != "cpu":
        return f"it runs on CPU only, not {torch.device(device).type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 or bfloat16, not {dtype}"
    if head_dim > MAX_HEAD_DIM or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return (f"it takes head_dim <= {MAX_HEAD_DIM} and <= {MAX_GROUP} query heads per KV head, got "
                f"head_dim {head_dim}, {num_heads} / {num_kv_heads} heads")
    if not available(kv_cache_dtype):
        return "it could not be built here (no C compiler, or the build failed: see the log)"
    return None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Attention of one new token per request over its cached context.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` (RoPE applied), the cache's dtype.
        k_cache, v_cache: one layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            holding each request's context including the new token; with ``kv_cache_dtype``
            "int8" / "fp8_e4m3", 8-bit codes and ``k_scale`` / ``v_scale`` ``[num_blocks,
            block_size, num_kv_heads]`` float16 (``mm_kv_cache_management.kv_quant``).
        block_tables: ``[num_seqs, max_blocks]`` int64 (padding entries are never read).
        context_lens: ``[num_seqs]`` int64, tokens in cache per request (>= 1).
        scale: softmax scale.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: ``q`` and the caches differ in dtype or device, or a cache is not contiguous.
        RuntimeError: the kernel is not available, or refused the sizes (a context longer
            than its block table, head_dim > 256, more than 16 query heads per KV head).
    """
    if kv_cache_dtype != "auto":
        return _paged_decode_q8(q, k_cache, v_cache, k_scale, v_scale, kv_cache_dtype, block_tables,
                                context_lens, scale)
    lib = _library()
    if lib is None:
        raise RuntimeError("the decode attention kernel is not available (see the log)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != q.dtype or cache.device.type != "cpu" or q.device.type != "cpu" or not cache.is_contiguous():
            raise ValueError(f"decode kernel: {name} must be a contiguous CPU tensor of q's dtype {q.dtype}, "
                             f"got {cache.dtype} on {cache.device} (contiguous: {cache.is_contiguous()})")
    q, tables, lens = _prepared(q, block_tables, context_lens)
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    fn = lib.paged_decode_bf16 if q.dtype == torch.bfloat16 else lib.paged_decode_f32
    status = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
                lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(),
                torch.get_num_threads())
    _check(status, q, num_kv_heads, tables, lens)
    return out


def _prepared(q, block_tables, context_lens):
    """q contiguous; block tables and context lengths as contiguous int64."""
    q = q.contiguous()
    tables = block_tables if block_tables.dtype == torch.int64 and block_tables.is_contiguous() else \
        block_tables.to(torch.int64).contiguous()
    lens = context_lens if context_lens.dtype == torch.int64 and context_lens.is_contiguous() else \
        context_lens.to(torch.int64).contiguous()
    return q, tables, lens


def _check(status: int, q, num_kv_heads: int, tables, lens) -> None:
    if status != 0:
        raise RuntimeError(f"decode attention kernel refused the sizes: heads {q.shape[1]}/{num_kv_heads}, "
                           f"head_dim {q.shape[2]}, block tables {tuple(tables.shape)}, contexts up to {int(lens.max())}")


def _paged_decode_q8(q, k_cache, v_cache, k_scale, v_scale, kv_cache_dtype, block_tables, context_lens, scale):
    """``paged_decode_attention`` over an 8-bit cache (same arguments, same result)."""
    lib = _library_q8()
    if lib is None:
        raise RuntimeError("the 8-bit KV decode attention kernel is not available (see the log)")
    if q.dtype not in (torch.float32, torch.bfloat16) or q.device.type != "cpu":
        raise ValueError(f"decode kernel: q must be a float32 / bfloat16 CPU tensor, got {q.dtype} on {q.device}")
    for name, t, want in (("k_cache", k_cache, 1), ("v_cache", v_cache, 1), ("k_scale", k_scale, 2),
                          ("v_scale", v_scale, 2)):
        if t is None or t.element_size() != want or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"decode kernel ({kv_cache_dtype} KV): {name} must be a contiguous CPU tensor of "
                             f"{want}-byte elements, got {None if t is None else (t.dtype, t.device)}")
    q, tables, lens = _prepared(q, block_tables, context_lens)
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    fmt = "i8" if kv_cache_dtype == "int8" else "fp8"
    fn = getattr(lib, f"paged_decode_{fmt}_{'bf16' if q.dtype == torch.bfloat16 else 'f32'}")
    status = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
                _code_table(kv_cache_dtype).data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(),
                torch.get_num_threads())
    _check(status, q, num_kv_heads, tables, lens)
    return out


def store_int8(kv_cache, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``kv_cache.write(layer, slot_mapping, k, v)`` for an int8 CPU cache in one C call after
    the rotation: bit-identical codes and scales (``csrc/paged_decode_q8.c`` quantize_store_i8;
    finite K/V), without PyTorch's dozen small ops per layer.

    Args:
        kv_cache: a ``PagedKVCache`` (or contiguous) with ``kv_cache_dtype`` "int8" on CPU.
        slot_mapping: ``[num_tokens]`` flat slots; k, v: ``[num_tokens, num_kv_heads, head_dim]``.

    Raises:
        RuntimeError: the kernel is not available, or a slot is outside the cache.
    """
    lib = _library_q8()
    if lib is None:
        raise RuntimeError("the 8-bit KV kernel is not available (see the log)")
    rows = hadamard_rotate(torch.stack([k, v.to(k.dtype)]))  # [2, T, kv_heads, head_dim] fp32, as write's
    slots = slot_mapping.to(torch.int64).contiguous()
    k_codes, v_codes, k_scale, v_scale = kv_cache.layer_kv(layer)  # [blocks, block_size, kv_heads, (head_dim)]
    num_slots = k_scale.shape[0] * k_scale.shape[1]
    status = lib.quantize_store_i8(rows.data_ptr(), slots.data_ptr(), rows.shape[1], rows.shape[2], rows.shape[3],
                                   num_slots, k_codes.data_ptr(), v_codes.data_ptr(), k_scale.data_ptr(),
                                   v_scale.data_ptr())
    if status != 0:
        raise RuntimeError(f"int8 KV store: a slot of {slots.tolist()} is outside the cache's {num_slots}")
