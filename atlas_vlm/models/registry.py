"""Model registry: which Hugging Face checkpoints Atlas VLM runs, and with which classes.

A model family is one file (its decoder / vision glue) plus one ``ModelFamily`` line in
``FAMILIES`` below. A checkpoint is matched by its config's ``architectures`` first (the HF
convention, as vLLM's ``ModelRegistry``), then by ``model_type``; anything else is refused at
load time with the list of supported architectures.

This module imports nothing from the rest of ``atlas_vlm`` at import time (classes are named
as ``"module:attr"`` strings and imported on demand), so ``arch.py`` and ``loader.py`` can both
read it without cycles.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one Atlas VLM implements."""


@dataclass(frozen=True)
class ModelFamily:
    """One supported family.

    Attributes:
        name: our family name (``ModelArch.family``), e.g. ``"qwen2_vl"``.
        architectures: HF ``config.architectures`` entries served by this family.
        model_types: HF ``config.model_type`` values (fallback when ``architectures`` is absent).
        model_cls: ``"module:Class"`` of the decoder built from ``ModelArch`` (``CausalLM``).
        nested_text_config: the decoder fields live in ``hf_config.text_config`` (VLMs).
        qkv_bias: ``True`` / ``False`` fixed by the family (Qwen2: True, Qwen3: False), or
            ``None``: read ``attention_bias`` from the config (Llama).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3, HF ``Qwen3Attention``).
        multimodal: takes images (has a ``vision_config``).
        mrope: positions are M-RoPE's ``[3, num_tokens]`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).
        mm_inputs: ``"module:Class"`` of the family's ``engine.mm_inputs.MediaInputs``
            (media loading, preprocessing, placeholder ids, positions); None for text models.
        vision_tower: ``"module:Class"`` of its vision tower, built by
            ``Class.from_hf_config(hf_config, state_dict, dtype=, device=)``; None for text models.
        modalities: the media a prompt of this family may carry.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    model_cls: str = "atlas_vlm.models.decoder:CausalLM"
    nested_text_config: bool = False
    qkv_bias: bool | None = None
    qk_norm: bool = False
    multimodal: bool = False
    mrope: bool = False
    mm_inputs: str | None = None
    vision_tower: str | None = None
    modalities: tuple[str, ...] = ()


_QWEN_VL = dict(nested_text_config=True, multimodal=True, mrope=True, modalities=("image", "video"),
                mm_inputs="atlas_vlm.engine.mm_inputs:QwenVLInputs")

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), ("llama",)),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qkv_bias=None, qk_norm=True),
    ModelFamily("qwen2_vl", ("Qwen2VLForConditionalGeneration",), ("qwen2_vl",), qkv_bias=True,
                vision_tower="mm_token_pipeline.vision:VisionEncoder", **_QWEN_VL),
    ModelFamily("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), ("qwen2_5_vl",), qkv_bias=True,
                vision_tower="mm_token_pipeline.vision:VisionEncoder", **_QWEN_VL),
    ModelFamily("qwen3_vl", ("Qwen3VLForConditionalGeneration",), ("qwen3_vl",),
                model_cls="atlas_vlm.models.qwen3_vl:Qwen3VLForCausalLM", qkv_bias=None, qk_norm=True,
                vision_tower="mm_token_pipeline.qwen3_vl:Qwen3VLVisionEncoder", **_QWEN_VL),
    # Qwen3.5 is hybrid (Gated DeltaNet + gated attention); its tower is Qwen3-VL's without DeepStack.
    # The text-only Qwen3_5ForCausalLM checkpoint (a qwen3_5_text config, no vision_config) is its own
    # line: the same decoder, no tower, no processor settings.
    ModelFamily("qwen3_5", ("Qwen3_5ForConditionalGeneration",), ("qwen3_5",),
                model_cls="atlas_vlm.models.qwen3_5:Qwen3_5ForCausalLM",
                vision_tower="atlas_vlm.models.qwen3_5.vision:Qwen3_5VisionEncoder", **_QWEN_VL),
    ModelFamily("qwen3_5_text", ("Qwen3_5ForCausalLM",), ("qwen3_5_text",),
                model_cls="atlas_vlm.models.qwen3_5:Qwen3_5ForCausalLM", nested_text_config=True, mrope=True),
    ModelFamily("smolvlm", ("SmolVLMForConditionalGeneration",), ("smolvlm",),
                nested_text_config=True, qkv_bias=None, multimodal=True, modalities=("image", "video"),
                mm_inputs="atlas_vlm.engine.mm_inputs:SmolVLMInputs",
                vision_tower="mm_token_pipeline.smolvlm:SmolVLMVisionEncoder"),
)

SUPPORTED_ARCHITECTURES: dict[str, str] = {a: f.name for f in FAMILIES for a in f.architectures}
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def get_family(name: str) -> ModelFamily:
    """The family called ``name``. Raises ``UnsupportedModelError`` for an unknown name."""
    if name not in _BY_NAME:
        raise UnsupportedModelError(f"unknown model family {name!r}; known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def resolve_family(hf_config) -> ModelFamily:
    """The family of a transformers config: by ``architectures``, then ``model_type``.

    Raises:
        UnsupportedModelError: neither matches; the message lists every supported architecture.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return _BY_NAME[SUPPORTED_ARCHITECTURES[a]]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise UnsupportedModelError(
        f"unsupported architecture {archs or model_type!r}; "
        f"Atlas VLM runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def text_config_of(hf_config, family: ModelFamily | None = None):
    """The config holding the decoder's fields (``text_config`` for VLMs, else the config itself)."""
    family = family or resolve_family(hf_config)
    nested = getattr(hf_config, "text_config", None) if family.nested_text_config else None
    return nested or hf_config


def import_named(path: str):
    """Import ``"module:attr"`` and return the attribute."""
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def model_class(family: ModelFamily) -> type:
    """Import and return ``family.model_cls``."""
    return import_named(family.model_cls)
