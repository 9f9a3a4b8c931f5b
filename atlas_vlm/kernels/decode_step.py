"""A decode step of a quantized model in one C call (``csrc/decode_step.c``), over tensors.

On CPU a decode token of a small quantized model spends about as long between its kernels
(Python, module calls, one OpenMP fork and join per op) as in them: SmolLM2-135M as its Q4_1
GGUF, one thread, ~10 ms in the quantized matmuls and ~5 ms around them. ``DecodeLayers`` runs
every decoder layer of a decode-only step (the embeddings in, the final norm's output out)
through the same C functions the op-by-op path calls (``quant_kernel``'s tiles, ``fused``'s
norms / RoPE / SwiGLU, ``decode_kernel``'s attention), in the same order and roundings, so
its output has the same bits (tested); only the overhead between them goes.

This module takes tensors only (each layer's ``LayerTensors``: quantized projections as
``quant_kernel.KernelTensors`` or GGUF ones as stored as ``GGUFTensors``, norm weights, the layer's K/V cache); walking a model to
collect them, deciding where the step serves and reading a step's attention metadata is
``worker.decode_step.DecodeStep``'s job. Rows: a decode row is a request's one decode token or
one of its speculative verification rows (``1 + d`` consecutive rows at consecutive positions,
as ``worker.input_prep`` lays them out): each row carries its own slot, RoPE row, block table
row and context length (its request's keys up to and including its own); every row's K/V is
written before any row attends, so a drafted step is verified in the same one call with the
op-by-op path's bits.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from atlas_vlm import hardware
from atlas_vlm.kernels import cbuild, gguf_kernel, quant_kernel
from atlas_vlm.kernels.quant_kernel import KernelTensors

SOURCE = Path(__file__).with_name("csrc") / "decode_step.c"


class _GParts(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p * 4), ("n", ctypes.c_int64 * 4), ("type", ctypes.c_int32 * 4),
                ("nparts", ctypes.c_int32)]


class _QLinear(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("gs", ctypes.c_int64),
                ("scale_f16", ctypes.c_int32), ("int4", ctypes.c_int32), ("gguf", ctypes.POINTER(_GParts))]


class GGUFTensors(NamedTuple):
    """A GGUF projection as stored for the C step: ``parts`` ``(packed, qtype, rows)`` (up to 4,
    outputs side by side: a fused q / k / v or gate / up), each ``gguf_kernel.repack``'s bytes
    of a Q4_K / Q6_K / Q8_0 tensor; ``bias`` fp32 ``[out_features]`` or None. The step runs them with
    ``gguf_matmul_packed``'s bits (q8_K activations, the bias added in fp32)."""

    parts: tuple[tuple[torch.Tensor, str, int], ...]
    bias: torch.Tensor | None
    in_features: int
    out_features: int


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear), ("down", _QLinear),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class LayerTensors(NamedTuple):
    """One decoder layer as the C step reads it: the four projections (``qkv``, ``o``,
    ``gate_up``, ``down``: int4 / int8 ``KernelTensors`` or ``GGUFTensors``), the RMSNorm weights (``q_norm`` / ``k_norm``: Qwen3's per-head
    norms, else None) and the layer's ``k_cache`` / ``v_cache`` ``[num_blocks, block_size,
    kv_heads, head_dim]`` in the model dtype."""

    qkv: KernelTensors | GGUFTensors
    o: KernelTensors | GGUFTensors
    gate_up: KernelTensors | GGUFTensors
    down: KernelTensors | GGUFTensors
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@functools.cache
def _library() -> ctypes.CDLL | None:
    # libmvec's vector expf where it links; the CPU's VNNI flags where the compiler knows them
    lib = cbuild.load(SOURCE, quant_kernel.compile_flags(), cbuild.LIBMVEC_ATTEMPTS, "decode steps run op by op")
    if lib is None and hardware.cpu_features().int8_dot_flags:
        lib = cbuild.load(SOURCE, quant_kernel.compile_flags(int8_dot=False), cbuild.LIBMVEC_ATTEMPTS,
                          "decode steps run op by op")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.decode_layers.argtypes = [p, i64, p, p, p, ctypes.c_float, p, i64, i64, i64, i64, i64, i64, p, p, p, i64, p,
                                  i64, p, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.decode_layers.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether ``csrc/decode_step.c`` builds and loads here (built on first call)."""
    return _library() is not None


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _qlinear(t: KernelTensors | GGUFTensors, keep: list) -> _QLinear:
    """The C struct of one projection; ``keep`` holds what its pointers point at."""
    if isinstance(t, GGUFTensors):
        if not 1 <= len(t.parts) <= 4 or sum(n for _, _, n in t.parts) != t.out_features:
            raise ValueError(f"a GGUF projection takes 1-4 parts of {t.out_features} rows in all, got "
                             f"{[(q, n) for _, q, n in t.parts]}")
        g = _GParts(nparts=len(t.parts))
        for i, (packed, qtype, n) in enumerate(t.parts):
            if qtype not in gguf_kernel.PACKED_TYPES or not packed.is_contiguous():
                raise ValueError(f"GGUF part {i} is {qtype}: the step runs {gguf_kernel.PACKED_TYPES} repacked")
            g.w[i], g.n[i], g.type[i] = packed.data_ptr(), n, gguf_kernel.TYPES[qtype][0]
        keep.append(g)
        return _QLinear(None, None, None, _ptr(t.bias), t.out_features, t.in_features, 0, 0, 0, ctypes.pointer(g))
    return _QLinear(t.qweight.data_ptr(), t.scales.data_ptr(), _ptr(t.mins), _ptr(t.bias), t.out_features,
                    t.in_features, t.group_size, int(t.scales.dtype == torch.float16), int(t.int4))


class DecodeLayers:
    """Every decoder layer, the final norm and (optionally) a quantized LM head in one C call.

    Args:
        layers: each layer's tensors, in order (held: the C side keeps their pointers).
        norm_weight: the final RMSNorm's weight ``[hidden]``; ``eps`` its epsilon.
        head: the LM head's tensors when it is quantized on the kernel path, else None.
        sizes: ``(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size)``.
        num_slots, block_size: the KV cache's token slots and tokens per block.

    Raises:
        RuntimeError: ``csrc/decode_step.c`` does not build here (check :func:`available`).
    """

    def __init__(self, layers: list[LayerTensors], norm_weight: torch.Tensor, eps: float,
                 head: KernelTensors | GGUFTensors | None, sizes: tuple[int, int, int, int, int], num_slots: int, block_size: int):
        self.lib = _library()
        if self.lib is None:
            raise RuntimeError("the decode step does not build here (csrc/decode_step.c)")
        self.tensors, self.norm_weight = list(layers), norm_weight  # kept alive: the structs hold pointers
        self.keep: list = [head]
        ql = functools.partial(_qlinear, keep=self.keep)
        self.layers = (_Layer * len(layers))(*(
            _Layer(ql(t.qkv), ql(t.o), ql(t.gate_up), ql(t.down), t.in_norm.data_ptr(),
                   t.post_norm.data_ptr(), _ptr(t.q_norm), _ptr(t.k_norm), t.k_cache.data_ptr(), t.v_cache.data_ptr())
            for t in layers))
        self.head = None if head is None else ql(head)
        self.vocab = 0 if head is None else head.out_features
        self.eps, self.sizes, self.num_slots, self.block_size = eps, sizes, num_slots, block_size
        self.scale = sizes[3] ** -0.5

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings ``x`` ``[B, hidden]`` (``cos`` / ``sin`` ``[B, head_dim]``: each row's
        position; ``slot_mapping`` ``[B]``, ``block_tables`` ``[B, max_blocks]`` int32,
        ``context_lens`` ``[B]`` int32: each row's slot, block table row and context length) ->
        (the final norm's output ``[B, hidden]``, fp32 logits ``[B, vocab]`` when the LM head
        is quantized (what ``compute_logits`` gives, the same bits), else None).

        Raises:
            RuntimeError: the kernel refused the step (a slot or context outside the cache).
        """
        out = x.contiguous().clone()  # [B, hidden]: the embeddings in, the final norm's output out
        cos, sin = cos.contiguous(), sin.contiguous()  # [B, head_dim], held across the call
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        d, h, kv, hd, inter = self.sizes
        logits = out.new_empty(out.shape[0], self.vocab) if self.head is not None else None  # [B, vocab], the dtype
        status = self.lib.decode_layers(
            self.layers, len(self.layers), self.norm_weight.data_ptr(),
            None if self.head is None else ctypes.byref(self.head), _ptr(logits), self.eps, out.data_ptr(),
            out.shape[0], d, h, kv, hd, inter, cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), self.num_slots, block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
            self.block_size, self.scale, int(x.dtype == torch.bfloat16), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the decode step refused a batch of {out.shape[0]} (slots {slots.tolist()}, "
                               f"contexts {context_lens.tolist()}, block tables {tuple(block_tables.shape)})")
        return out, None if logits is None else logits.float()
