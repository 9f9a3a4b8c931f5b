"""The decoder's small per-layer ops, fused for CPU (``csrc/fused_ops.c``) behind the same
functions as their PyTorch references.

One decode token of a 30-layer model runs some 60 small PyTorch ops a layer (norms, RoPE,
K/V writes, SwiGLU, residual adds), each a few microseconds of dispatch for a few hundred
values: measured on SmolLM2-135M with quantized weights, one thread, they took as long as
all the weight reads together. Three C functions replace them (vLLM's CUDA ops do the same
job on GPUs):

- :func:`rms_norm`: RMSNorm, optionally after adding the residual (``fused_add_rms_norm``);
- :func:`silu_and_mul`: SwiGLU's ``silu(gate) * up`` over the fused ``gate_up`` output;
- :func:`rope_write_kv`: split ``qkv``, Qwen3's q/k RMSNorm, RoPE on q and k, K and V
  written to their cache slots, q returned (its reference rotates with :func:`apply_rotary`,
  HF's ``rotate_half`` RoPE in PyTorch, which ``layers.rotary`` re-exports for the decoders:
  it lives here so the kernels import nothing from ``layers/``).

Each rounds to the tensor dtype where the reference does, so fp32 differs only in reduction
order (the norms sum squares in fp64) and bf16 by at most an ulp where a sum lands on a
rounding boundary (``tests/parity/test_fused_ops.py``). The C path runs for CPU tensors in
fp32 / bf16 when the library builds (``kernels/cbuild.py``; ``available()``), outside
``torch.compile`` (the compiled decode step fuses the references itself); everywhere else the
reference runs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from atlas_vlm.kernels import cbuild, decode_kernel

SOURCE = Path(__file__).with_name("csrc") / "fused_ops.c"
MAX_NORM_DIM, MAX_HEAD_DIM = 16384, 1024  # as the C source (MAX_ROW: a norm's or SwiGLU's row)


def compile_flags() -> list[str]:
    return cbuild.cpu_flags("-ffp-contract=off")  # the roundings' order is part of the answer


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cbuild.load(SOURCE, compile_flags(), cbuild.LIBMVEC_ATTEMPTS, "the decoder's small ops run as PyTorch ops")
    if lib is None:
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.rms_norm.argtypes = [p, p, p, i64, i64, f32, p, i32, i32]
    lib.silu_mul.argtypes = [p, i64, i64, p, i32, i32]
    lib.rope_kv.argtypes = [p, p, p, p, p, f32, i64, i64, i64, i64, p, p, p, p, i64, i32, i32]
    for fn in (lib.rms_norm, lib.silu_mul, lib.rope_kv):
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the fused ops are built and loaded (builds them on the first call). Tests patch
    this to fake either answer."""
    return _library() is not None


_FAST_DTYPES = (torch.float32, torch.bfloat16)


def _fast(*tensors: torch.Tensor) -> bool:
    """The C path serves: CPU tensors of one dtype (fp32 / bf16), contiguous, the library
    built, not inside ``torch.compile``."""
    t = tensors[0]
    if t.device.type != "cpu" or t.dtype not in _FAST_DTYPES or torch.compiler.is_compiling() or not available():
        return False
    for x in tensors:
        if x.dtype != t.dtype or not x.is_contiguous():
            return False
    return True


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---- RMSNorm -------------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF ``LlamaRMSNorm`` (fp32 statistics, cast back, times ``weight``) of ``x``, or of
    ``residual + x`` when ``residual`` is given. Returns ``(out, residual + x or None)``."""
    if residual is not None:
        x = residual = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`rms_norm_reference` (``x`` ``[..., D]``, ``weight`` ``[D]``); on the C path
    ``residual`` is updated in place (and returned), as vLLM's ``fused_add_rms_norm``."""
    if not _fast(x, weight) or (residual is not None and not _fast(x, residual)) or x.shape[-1] > MAX_NORM_DIM:
        return rms_norm_reference(x, weight, eps, residual)
    d = x.shape[-1]
    out = torch.empty_like(x)
    status = _library().rms_norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), x.numel() // d, d, eps,
                                 out.data_ptr(), int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"fused rms_norm refused x {tuple(x.shape)}")
    return out, residual


# ---- SwiGLU --------------------------------------------------------------------------------------

def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[..., 2 I]`` (gate first) -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul_reference`, one C call on the fast path."""
    if not _fast(gate_up) or gate_up.shape[-1] // 2 > MAX_NORM_DIM:
        return silu_and_mul_reference(gate_up)
    i = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], i)
    status = _library().silu_mul(gate_up.data_ptr(), gate_up.numel() // (2 * i), i, out.data_ptr(),
                                 int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"fused silu_and_mul refused {tuple(gate_up.shape)}")
    return out


# ---- RoPE + K/V write ----------------------------------------------------------------------------

def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by cos/sin ``[num_tokens, rotary_dim]`` (HF rotate_half
    form). Partial rotary (``rotary_dim < head_dim``, Qwen3.5): the first ``rotary_dim`` channels
    rotate, the rest pass through (HF ``apply_rotary_pos_emb`` of Qwen3.5)."""
    if cos.shape[-1] < x.shape[-1]:
        rot, rest = x[..., :cos.shape[-1]], x[..., cos.shape[-1]:]
        return torch.cat((apply_rotary(rot, cos, sin), rest), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class _ScratchKV:
    """One layer of ``t`` K/V rows in ``like``'s dtype, shaped as a cache of one-token blocks
    (``k_cache`` ``[1, t, 1, kv_heads, head_dim]``): where the fused op writes before an 8-bit
    cache quantizes."""

    def __init__(self, num_kv_heads: int, head_dim: int, t: int, like: torch.Tensor):
        self.spec = None
        self.k_cache = like.new_empty(1, t, 1, num_kv_heads, head_dim)
        self.v_cache = like.new_empty(1, t, 1, num_kv_heads, head_dim)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_cache[layer].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k.to(self.k_cache.dtype))
        self.v_cache[layer].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v.to(self.v_cache.dtype))


def rope_write_kv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int, kv_cache, layer: int, slot_mapping: torch.Tensor,
                            q_norm=None, k_norm=None) -> torch.Tensor:
    """Split ``qkv`` ``[T, (H + 2 KV) * Dh]``, apply ``q_norm`` / ``k_norm`` (RMSNorm modules
    over ``Dh``, Qwen3) and RoPE (cos / sin ``[T, Dh]``), write K and V to ``kv_cache`` at
    ``slot_mapping`` ``[T]`` (layer ``layer``); return q ``[T, H, Dh]``."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(-1, num_heads, head_dim)  # [T, heads, head_dim]
    k = k.view(-1, num_kv_heads, head_dim)  # [T, kv_heads, head_dim]
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    kv_cache.write(layer, slot_mapping, k, v.view(-1, num_kv_heads, head_dim))
    return q


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, kv_cache, layer: int, slot_mapping: torch.Tensor, q_norm=None,
                  k_norm=None) -> torch.Tensor:
    """:func:`rope_write_kv_reference` in one C call where it serves (the cache in ``qkv``'s
    dtype, ``head_dim`` even and <= 1024). An 8-bit cache (``kv_cache_dtype``): the C call
    writes K/V into scratch rows in ``qkv``'s dtype, which ``kv_cache.write`` then quantizes
    (int8 on CPU: ``decode_kernel.store_int8``, the same codes in one C call), so RoPE's
    arithmetic is the same whatever the cache stores."""
    if getattr(kv_cache.spec, "quantized", False):
        t = qkv.shape[0]
        scratch = _ScratchKV(kv_cache.spec.num_kv_heads, head_dim, t, qkv)
        q = rope_write_kv(qkv, cos, sin, num_heads, num_kv_heads, head_dim, scratch, 0,
                          torch.arange(t, device=qkv.device), q_norm, k_norm)
        k, v = scratch.k_cache[0].view(t, num_kv_heads, head_dim), scratch.v_cache[0].view(t, num_kv_heads, head_dim)
        if kv_cache.spec.kv_cache_dtype == "int8" and qkv.device.type == "cpu" and decode_kernel.available("int8"):
            decode_kernel.store_int8(kv_cache, layer, slot_mapping, k, v)  # write's codes, in one C call
        else:
            kv_cache.write(layer, slot_mapping, k, v)
        return q
    k_cache, v_cache = kv_cache.k_cache[layer], kv_cache.v_cache[layer]
    norms = [] if q_norm is None else [q_norm.weight, k_norm.weight]
    if not _fast(qkv, cos, sin, k_cache, v_cache, *norms) or head_dim > MAX_HEAD_DIM or head_dim % 2:
        return rope_write_kv_reference(qkv, cos, sin, num_heads, num_kv_heads, head_dim, kv_cache, layer,
                                       slot_mapping, q_norm, k_norm)
    t = qkv.shape[0]
    q = qkv.new_empty(t, num_heads, head_dim)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    eps = q_norm.eps if q_norm is not None else 0.0
    status = _library().rope_kv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), _ptr(norms[0] if norms else None),
                                _ptr(norms[1] if norms else None), eps, t, num_heads, num_kv_heads, head_dim,
                                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                k_cache.numel() // (num_kv_heads * head_dim), int(qkv.dtype == torch.bfloat16),
                                torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"fused rope_write_kv refused qkv {tuple(qkv.shape)} with head_dim {head_dim} "
                           f"or a slot outside the cache's {k_cache.shape[0] * k_cache.shape[1]}")
    return q
