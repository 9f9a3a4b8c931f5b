"""A decode step of a quantized model in one C call (``csrc/decode_step.c``).

On CPU a decode token of a small quantized model spends about as long between its kernels
(Python, module calls, one OpenMP fork and join per op) as in them: SmolLM2-135M as its Q4_1
GGUF, one thread, ~10 ms in the quantized matmuls and ~5 ms around them. ``DecodeStep`` runs
every decoder layer of a decode-only step (the embeddings in, the final norm's output out)
through the same C functions the op-by-op path calls (``quant_kernel``'s tiles, ``fused``'s
norms / RoPE / SwiGLU, ``decode_kernel``'s attention), in the same order and roundings, so
its output has the same bits (tested); only the overhead between them goes.

It serves a model whose every decoder projection is an ``Int8Linear`` / ``Int4Linear`` on
the kernel path, SwiGLU, fp32 or bf16, a KV cache in the model dtype, sizes the C kernels
take (``head_dim`` <= 256, <= 16 query heads per KV head), and a step whose every row is a
decode row (``DecodeBatch.all_tokens``), at most ``KERNEL_MAX_ROWS`` rows, no media rows. A
decode row is a request's one decode token or one of its speculative verification rows (a
decode token and its ``d`` drafts: ``1 + d`` consecutive rows at consecutive positions, as
``worker.input_prep`` lays them out): each row carries its own slot, RoPE row, block table row
and context length (its request's keys up to and including its own), every row's K/V is
written before any row attends, so a drafted step is verified in the same one call with the
op-by-op path's bits (a plain decode step is the case ``d = 0``).
``ModelRunner`` builds it once (:meth:`DecodeStep.build`, None where it does not serve, with
the reason) and calls it where :meth:`DecodeStep.applies`; everything else runs op by op.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from atlas_vlm import hardware
from atlas_vlm.kernels import cbuild, fused, quant_kernel
from atlas_vlm.layers.attention import AttentionMetadata
from atlas_vlm.layers.quant_linear import KERNEL_MAX_ROWS, Int4Linear, _QuantLinear

SOURCE = Path(__file__).with_name("csrc") / "decode_step.c"


class _QLinear(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("gs", ctypes.c_int64),
                ("scale_f16", ctypes.c_int32), ("int4", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear), ("down", _QLinear),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


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


def _qlinear(m: _QuantLinear) -> _QLinear:
    mins = m._mins()
    return _QLinear(m.qweight.data_ptr(), m.scales.data_ptr(), None if mins is None else mins.data_ptr(),
                    None if m._bias_f32 is None else m._bias_f32.data_ptr(), m.out_features, m.in_features,
                    m.group_size, int(m.scales.dtype == torch.float16), int(isinstance(m, Int4Linear)))


class DecodeStep:
    """Every decoder layer of a decode-only step in one C call (see the module docstring).

    Use :meth:`build`; ``__call__(x, cos, sin, meta)`` maps the embeddings ``x`` ``[B, hidden]``
    to the final norm's output ``[B, hidden]`` (and a quantized LM head's logits) and writes
    the step's K/V into the cache.
    """

    def __init__(self, model, kv_cache, lib: ctypes.CDLL):
        arch = model.arch
        self.model, self.kv_cache, self.lib = model, kv_cache, lib
        self.dtype = model.model.norm.weight.dtype
        layers = []
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(_Layer(
                _qlinear(attn.qkv_proj), _qlinear(attn.o_proj), _qlinear(mlp.gate_up_proj), _qlinear(mlp.down_proj),
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                None if attn.q_norm is None else attn.q_norm.weight.data_ptr(),
                None if attn.k_norm is None else attn.k_norm.weight.data_ptr(),
                kv_cache.k_cache[i].data_ptr(), kv_cache.v_cache[i].data_ptr()))
        self.layers = (_Layer * len(layers))(*layers)  # holds pointers into the model and the cache (both fixed)
        self.num_slots = kv_cache.k_cache[0].numel() // (arch.num_kv_heads * arch.head_dim)
        self.sizes = (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size)
        self.eps, self.scale = model.model.norm.eps, arch.head_dim ** -0.5
        head = model.lm_head  # a quantized head on the kernel path (GGUF's tied Q8_0) runs in the same call
        self.head = _qlinear(head) if isinstance(head, _QuantLinear) and head.use_kernel else None
        self.vocab = head.out_features if self.head is not None else 0

    @classmethod
    def build(cls, model, kv_cache, attention_backend: str) -> tuple[DecodeStep | None, str]:
        """``(DecodeStep, "")`` where it serves this model, else ``(None, why not)``."""
        arch = model.arch
        layers = getattr(getattr(model, "model", None), "layers", None)
        dtype = next(model.parameters()).dtype
        if layers is None or not hasattr(model.model, "norm"):
            return None, "not a decoder of the Llama / Qwen family"
        projections = [p for layer in layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(p, _QuantLinear) and p.use_kernel for p in projections):
            return None, "its decoder projections are not all quantized linears on the kernel path"
        if arch.hidden_act != "silu" or dtype not in (torch.float32, torch.bfloat16):
            return None, f"hidden_act {arch.hidden_act} / dtype {dtype} (needs SwiGLU, fp32 or bf16)"
        if attention_backend != "decode_kernel" or kv_cache.k_cache.dtype != dtype:
            return None, (f"attention backend {attention_backend}, KV stored as {kv_cache.k_cache.dtype} "
                          f"(needs the decode kernel, the cache in {dtype}: not an 8-bit kv_cache_dtype)")
        if max(arch.hidden_size, arch.intermediate_size) > fused.MAX_NORM_DIM:
            return None, f"hidden / intermediate size over {fused.MAX_NORM_DIM} (the C kernels' row bound)"
        if not fused.available():
            return None, "the fused ops do not build here"
        lib = _library()
        if lib is None:
            return None, "the decode step does not build here"
        return cls(model, kv_cache, lib), ""

    def applies(self, meta, num_rows: int, has_media: bool) -> bool:
        """A decode-only step (every row a decode token or a verification row) of at most
        ``KERNEL_MAX_ROWS`` rows, no media rows, outside ``torch.compile``."""
        if has_media or not isinstance(meta, AttentionMetadata) or meta.bucketed is None:
            return False
        batch = meta.bucketed.decode_batch
        return (batch is not None and batch.all_tokens and num_rows <= KERNEL_MAX_ROWS[self.dtype]
                and not torch.compiler.is_compiling())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings ``x`` ``[B, hidden]`` (``cos`` / ``sin`` ``[B, head_dim]``: each row's
        position; ``meta``: each row's slot, block table row and context length) -> (the
        final norm's output ``[B, hidden]``, fp32
        logits ``[B, vocab]`` when the LM head is quantized (what ``compute_logits`` gives,
        the same bits), else None).

        Raises:
            RuntimeError: the kernel refused the step (a slot or context outside the cache).
        """
        batch = meta.bucketed.decode_batch
        out = x.contiguous().clone()  # [B, hidden]: the embeddings in, the final norm's output out
        cos, sin = cos.contiguous(), sin.contiguous()  # [B, head_dim], held across the call
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        tables, lens = batch.block_tables, batch.context_lens
        d, h, kv, hd, inter = self.sizes
        logits = out.new_empty(out.shape[0], self.vocab) if self.head is not None else None  # [B, vocab], the dtype
        status = self.lib.decode_layers(
            self.layers, len(self.layers), self.model.model.norm.weight.data_ptr(),
            None if self.head is None else ctypes.byref(self.head), None if logits is None else logits.data_ptr(),
            self.eps, out.data_ptr(),
            out.shape[0], d, h, kv, hd, inter, cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), self.num_slots, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
            self.kv_cache.k_cache.shape[2], self.scale, int(x.dtype == torch.bfloat16), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"the decode step refused a batch of {out.shape[0]} (slots {slots.tolist()}, "
                               f"contexts {lens.tolist()}, block tables {tuple(tables.shape)})")
        return out, None if logits is None else logits.float()
