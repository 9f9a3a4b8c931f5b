"""Build a decoder with quantized linears from a safetensors checkpoint: on the ``meta``
device first, each projection replaced by the module its weights need, then tensors loaded
into it (no dense copy of the quantized layers is ever allocated)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from atlas_vlm.quantization import (AT_LOAD_METHODS, UnsupportedQuantizationError, at_load_module, build_empty,
                                    materialize, replace_linears)


def load_quantized_weights(model_cls, arch, text_config, files: list[Path], method: str, quant_config: dict | None,
                           dense_loader: Callable) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model with quantized decoder projections, loaded from ``files``.

    Args:
        model_cls / arch / text_config: as ``loader.load_model`` builds the dense model.
        files: the checkpoint's safetensors files.
        method: "int8" / "int4" (quantized at load from dense weights) or "awq" / "gptq".
        quant_config: the checkpoint's ``quantization_config`` (awq / gptq).
        dense_loader: ``loader._load_weights`` (loads dense tensors and, for modules with
            ``load_dense_rows``, quantizes rows as they are read).

    Returns:
        ``(model, vision_state_dict)``.

    Raises:
        UnsupportedQuantizationError: an unknown method or config field value (named).
    """
    model = build_empty(model_cls, arch, text_config)
    if method in AT_LOAD_METHODS:
        replace_linears(model, at_load_module(method))
        materialize(model)
        return model, dense_loader(model, files)
    if method in ("awq", "gptq"):
        from atlas_vlm.quantization.awq_gptq import load_awq_gptq

        return load_awq_gptq(model, files, method, quant_config or {}, dense_loader)
    raise UnsupportedQuantizationError(f"quantization {method!r} cannot load a safetensors folder")
