"""Where the one-call C decode step serves, and the model walk that feeds it.

``kernels.decode_step.DecodeLayers`` runs every decoder layer of a decode-only step in one C
call over tensors; this module decides whether it serves a loaded model, collects those tensors
from the model (each layer's quantized projections through ``kernel_tensors()``, its norms, its
slice of the KV cache) and reads a step's attention metadata into the call's arguments.

It serves a model whose every decoder projection is an ``Int8Linear`` / ``Int4Linear`` on
the kernel path or a ``GGUFLinear`` with interleaved rows (Q4_K / Q6_K / Q8_0 as stored), SwiGLU, fp32 or bf16, a KV cache in the model dtype, sizes the C kernels
take (``head_dim`` <= 256, <= 16 query heads per KV head), and a step whose every row is a
decode row (``DecodeBatch.all_tokens``: a decode token or a speculative verification row), at
most ``KERNEL_MAX_ROWS`` rows, no media rows. ``ModelRunner`` builds it once
(:meth:`DecodeStep.build`, None where it does not serve, with the reason) and calls it where
:meth:`DecodeStep.applies`; everything else runs op by op.
"""

from __future__ import annotations

import torch

from atlas_vlm.kernels import decode_step as kernel
from atlas_vlm.kernels import fused
from atlas_vlm.layers.attention import AttentionMetadata
from atlas_vlm.layers.gguf_linear import GGUFLinear
from atlas_vlm.layers.gguf_stored import GGUFFusedLinear
from atlas_vlm.layers.quant_linear import KERNEL_MAX_ROWS

__all__ = ["DecodeStep"]


def _kernel_tensors(module):
    """A projection's kernel tensors (``KernelTensors``, or ``GGUFTensors`` for a ``GGUFLinear``
    with interleaved rows or a ``GGUFFusedLinear`` of such parts), or None where it is not on a
    kernel path."""
    if isinstance(module, GGUFLinear):
        if module.packed is None:  # a type without the interleaved kernel, or no C kernel
            return None
        bias = None if module.bias is None else module.bias.float().contiguous()  # [N], held by the step
        return kernel.GGUFTensors(((module.packed, module.qtype, module.out_features),), bias, module.in_features,
                                  module.out_features)
    if isinstance(module, GGUFFusedLinear):  # parts of different types (Q4_K q / k beside a Q6_K v)
        parts = [_kernel_tensors(p) for p in module.parts]
        if not all(isinstance(t, kernel.GGUFTensors) for t in parts) or sum(len(t.parts) for t in parts) > 4:
            return None
        bias = None if all(t.bias is None for t in parts) else torch.cat(
            [t.bias if t.bias is not None else torch.zeros(t.out_features) for t in parts])  # [N] fp32
        return kernel.GGUFTensors(tuple(pp for t in parts for pp in t.parts), bias, module.in_features,
                                  module.out_features)
    tensors = getattr(module, "kernel_tensors", None)
    return tensors() if callable(tensors) else None


class DecodeStep:
    """Every decoder layer of a decode-only step in one C call (see the module docstring).

    Use :meth:`build`; ``__call__(x, cos, sin, meta)`` maps the embeddings ``x`` ``[B, hidden]``
    to the final norm's output ``[B, hidden]`` (and a quantized LM head's logits) and writes
    the step's K/V into the cache.
    """

    def __init__(self, model, kv_cache):
        arch, decoder = model.arch, model.model
        self.dtype = decoder.norm.weight.dtype
        layers = [kernel.LayerTensors(
            _kernel_tensors(layer.self_attn.qkv_proj), _kernel_tensors(layer.self_attn.o_proj),
            _kernel_tensors(layer.mlp.gate_up_proj), _kernel_tensors(layer.mlp.down_proj),
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            None if layer.self_attn.q_norm is None else layer.self_attn.q_norm.weight,
            None if layer.self_attn.k_norm is None else layer.self_attn.k_norm.weight,
            kv_cache.k_cache[i], kv_cache.v_cache[i]) for i, layer in enumerate(decoder.layers)]
        # a quantized head on the kernel path (GGUF's tied Q8_0) runs in the same call
        self.layers = kernel.DecodeLayers(
            layers, decoder.norm.weight, decoder.norm.eps, _kernel_tensors(model.lm_head),
            (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size),
            num_slots=kv_cache.k_cache[0].numel() // (arch.num_kv_heads * arch.head_dim),
            block_size=kv_cache.k_cache.shape[2])

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
        if not all(_kernel_tensors(p) is not None for p in projections):
            return None, ("its decoder projections are not all quantized linears on the kernel path (Int4Linear / "
                          "Int8Linear, or GGUFLinear of Q4_K / Q6_K / Q8_0)")
        if arch.hidden_act != "silu" or dtype not in (torch.float32, torch.bfloat16):
            return None, f"hidden_act {arch.hidden_act} / dtype {dtype} (needs SwiGLU, fp32 or bf16)"
        if attention_backend != "decode_kernel" or kv_cache.k_cache.dtype != dtype:
            return None, (f"attention backend {attention_backend}, KV stored as {kv_cache.k_cache.dtype} "
                          f"(needs the decode kernel, the cache in {dtype}: not an 8-bit kv_cache_dtype)")
        if max(arch.hidden_size, arch.intermediate_size) > fused.MAX_NORM_DIM:
            return None, f"hidden / intermediate size over {fused.MAX_NORM_DIM} (the C kernels' row bound)"
        if not fused.available():
            return None, "the fused ops do not build here"
        if not kernel.available():
            return None, "the decode step does not build here"
        return cls(model, kv_cache), ""

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
        """Embeddings ``x`` ``[B, hidden]`` (``cos`` / ``sin`` ``[B, head_dim]``; ``meta``: each
        row's slot, block table row and context length) -> (the final norm's output
        ``[B, hidden]``, fp32 logits ``[B, vocab]`` when the LM head is quantized, else None).

        Raises:
            RuntimeError: the kernel refused the step (a slot or context outside the cache).
        """
        batch = meta.bucketed.decode_batch
        return self.layers(x, cos, sin, meta.slot_mapping, batch.block_tables, batch.context_lens)
