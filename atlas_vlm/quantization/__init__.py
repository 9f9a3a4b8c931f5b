"""Quantized weights: which scheme a load uses, and building the decoder with quantized
linear modules in place of ``nn.Linear`` (names follow vLLM: ``quantization=``,
``quant_config``).

Schemes (``EngineConfig.quantization`` / ``LLM(..., quantization=...)``):

- ``None``: weights as stored: a folder's dense tensors, a ``.gguf``'s blocks in place
  (:mod:`atlas_vlm.quantization.gguf_stored`).
- ``"int8"``: weight-only int8 quantized at load from a dense checkpoint, round to nearest,
  one symmetric scale per output channel.
- ``"int4"``: weight-only int4 quantized at load, round to nearest, asymmetric, one scale
  and zero per group of 128 inputs (64 or 32 where 128 does not divide the layer's inputs:
  :func:`atlas_vlm.layers.quant_linear.int4_group_size`).
- ``"gguf"``: a ``.gguf`` file's tensors as stored (the same as None for a ``.gguf``).
- ``"gguf_int"``: a ``.gguf`` converted at load, exactly, to our ``Int4Linear`` / ``Int8Linear``
  tiles (:mod:`atlas_vlm.quantization.gguf_converted`; what ``"gguf"`` loaded before the
  as-stored layers): the one-call C decode step and the GPU's Triton matmuls run those tiles.
- ``"dequantize"``: a ``.gguf`` converted once to a dense fp32 folder in the cache (transformers'
  GGUF support): the old default, for comparisons.
- ``"awq"`` / ``"gptq"``: safetensors in their released layout, read from the checkpoint's
  ``quantization_config`` (:mod:`atlas_vlm.quantization.awq_gptq`).

The decoder's projections (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) are
quantized; embeddings, the LM head and norms stay dense (as vLLM), except GGUF, whose tensors
are taken as stored. The vision tower stays dense.
"""

from __future__ import annotations

import torch
from torch import nn

from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear, int4_group_size

QUANTIZATION_METHODS = ("int8", "int4", "gguf", "gguf_int", "dequantize", "awq", "gptq")
AT_LOAD_METHODS = ("int8", "int4")  # quantized from a dense checkpoint
DECODER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class UnsupportedQuantizationError(ValueError):
    """A quantization scheme, format or tensor type Atlas VLM does not run (named in the message)."""


def check_quantization(method: str | None) -> str | None:
    """Validate ``EngineConfig.quantization``.

    Raises:
        UnsupportedQuantizationError: not None and not one of ``QUANTIZATION_METHODS``.
    """
    if method is None or method in QUANTIZATION_METHODS:
        return method
    raise UnsupportedQuantizationError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {method!r}")


def checkpoint_quant_config(hf_config) -> dict | None:
    """The checkpoint's own ``quantization_config`` (``config.json``) as a dict, or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        text = getattr(hf_config, "text_config", None)
        qc = getattr(text, "quantization_config", None) if text is not None else None
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def resolve_quantization(requested: str | None, hf_config) -> tuple[str | None, dict | None]:
    """The scheme a folder checkpoint loads with: its own ``quantization_config`` wins
    (``quant_method`` "awq" / "gptq"); ``requested`` must then be None or the same method.

    Returns:
        ``(method, quant_config)``.

    Raises:
        UnsupportedQuantizationError: a ``quant_method`` other than awq / gptq (named), or
            ``requested`` disagrees with the checkpoint (both named).
    """
    check_quantization(requested)
    qc = checkpoint_quant_config(hf_config)
    if qc is None:
        if requested in ("awq", "gptq"):
            raise UnsupportedQuantizationError(f"quantization={requested!r} needs a checkpoint with a "
                                               f"quantization_config; this one has none")
        if requested in ("gguf", "gguf_int", "dequantize"):
            raise UnsupportedQuantizationError(f"quantization={requested!r} needs a .gguf file")
        return requested, None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise UnsupportedQuantizationError(f"checkpoint quantization_config.quant_method={method!r} is not supported; "
                                           f"Atlas VLM loads 'awq' and 'gptq' checkpoints (and dense ones with "
                                           f"quantization='int8' | 'int4')")
    if requested not in (None, method):
        raise UnsupportedQuantizationError(f"quantization={requested!r} disagrees with the checkpoint's "
                                           f"quantization_config.quant_method={method!r}")
    return method, qc


def _decoder_linears(model: nn.Module):
    for name, module in model.named_modules():
        if name.startswith("model.layers."):
            for child_name, child in module.named_children():
                if child_name in DECODER_LINEARS and isinstance(child, nn.Linear):
                    yield module, child_name, child


def replace_linears(model: nn.Module, make) -> int:
    """Replace every decoder projection ``nn.Linear`` (meta or not) by ``make(linear)``.

    Returns:
        the number replaced.
    """
    count = 0
    for parent, child_name, child in list(_decoder_linears(model)):
        setattr(parent, child_name, make(child))
        count += 1
    return count


def at_load_module(method: str):
    """A factory ``nn.Linear -> empty Int8Linear / Int4Linear`` for ``method`` "int8" / "int4"."""
    if method == "int8":
        return lambda lin: Int8Linear(lin.in_features, lin.out_features, lin.bias is not None)
    if method == "int4":
        return lambda lin: Int4Linear(lin.in_features, lin.out_features, lin.bias is not None,
                                      int4_group_size(lin.in_features))
    raise UnsupportedQuantizationError(f"{method!r} is not a quantize-at-load scheme ({AT_LOAD_METHODS})")


def build_empty(model_cls, arch, text_config) -> nn.Module:
    """The model with its parameters on the ``meta`` device (accelerate's
    ``init_empty_weights``; buffers and plain attributes such as RoPE frequencies real):
    nothing allocated for the dense weights."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return model_cls(arch, text_config)


def materialize(model: nn.Module, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> None:
    """Give every parameter still on ``meta`` uninitialised storage on ``device`` (in ``dtype``,
    or the parameter's own where None; to be loaded next) and re-tie ``lm_head`` to the
    embedding where the arch ties them."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=dtype or p.dtype, device=device), requires_grad=False)
    arch = getattr(model, "arch", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if arch is not None and arch.tie_word_embeddings and isinstance(emb, nn.Embedding) \
            and isinstance(getattr(model, "lm_head", None), nn.Linear):
        model.lm_head.weight = emb.weight
