"""Model registry: which Hugging Face checkpoints Atlas VLM runs, and with which classes.

A checkpoint is matched by its config's ``architectures`` first (the HF convention, as vLLM's
``ModelRegistry``), then by ``model_type``; anything else is refused at load time with the
list of supported architectures. Callers ask ``resolve_family(hf_config)`` (strict: the
loader) or ``find_family(hf_config)`` (lenient: the planner's formulas) and then read the
family's fields and hooks; no module outside ``atlas_vlm/models/`` compares ``model_type``
strings (``tests/models/test_family_hooks.py`` greps for that).

Adding a family = one folder + one ``ModelFamily`` line in ``FAMILIES`` + its tests:

- ``atlas_vlm/models/<family>/`` holds everything that is the family's own (add the folder to
  ``[tool.setuptools] packages`` in ``pyproject.toml``): its decoder when the shared one does
  not fit (``model.py``: a ``CausalLM`` subclass built from ``ModelArch``; hybrid families also
  expose ``state_spec()`` and ``num_kv_layers``), its vision tower (``vision.py``: a class with
  ``from_hf_config(hf_config, state_dict, dtype=, device=)`` and ``encode(items)``),
  its media inputs (``inputs.py``: an ``inputs.media.MediaInputs`` subclass: prompt ids,
  placeholder ids, M-RoPE positions) and its hooks (``family.py``: a
  ``family_hooks.FamilyHooks`` subclass: released image-processor defaults and settings,
  vision parameter count, vision activation shape, visual tokens per image / video).
  The folder's ``__init__.py`` stays import-free (only a docstring), so naming a family never
  imports its torch code.
- Shared layers stay outside the folders: ``models/decoder.py`` is the plain decoder of
  Llama, Qwen2, Qwen3 and the language models of Qwen2-VL, Qwen2.5-VL and SmolVLM (they
  differ only in fields of the registry line: ``qkv_bias``, ``qk_norm``, ``mrope``), so those
  families have no ``model.py``; ``mm_token_pipeline`` holds the media stages every family
  shares (image / video loading, ``smart_resize``, patchify, prompt expansion, M-RoPE).
- Qwen2-VL and Qwen2.5-VL are two registry lines on one folder (``qwen2_vl/``): the same
  tower code picks its HF class from the vision config.

The line's fields name code as ``"module:attr"`` strings, imported on demand
(``import_named``), so naming a family loads none of its code. ``tests/test_import_graph.py``
counts these strings as imports: the registry sits above the family folders it names, and a
family module never imports the registry or what reads it (``arch``'s ``from_hf_config``,
``param_count``, ``processor_settings``); ``loader``, ``memory_plan`` and the engine read it.
"""

from __future__ import annotations

import functools
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
        mm_inputs: ``"module:Class"`` of the family's ``inputs.media.MediaInputs``
            (media loading, preprocessing, placeholder ids, positions); None for text models.
        vision_tower: ``"module:Class"`` of its vision tower, built by
            ``Class.from_hf_config(hf_config, state_dict, dtype=, device=)``; None for text models.
        modalities: the media a prompt of this family may carry.
        mrope_interleaved: M-RoPE sections interleaved over the rotary dims, not in blocks
            (HF Qwen3-VL always interleaves; ``ModelArch.mrope_interleaved``).
        default_mrope_section: the ``mrope_section`` taken when the config states none (HF
            Qwen3-VL's default (24, 20, 20)); None: a config without one is refused.
        hooks: ``"module:Class"`` of the family's ``family_hooks.FamilyHooks`` subclass
            (image-processor defaults, vision sizes for the planner); None: the base class
            (a text-only family: no vision tower).
        vision_model_types: ``vision_config.model_type`` values whose sizes this family's
            hooks compute (``find_family`` matches a config's tower by them; SmolVLM's also
            covers Idefics3's SigLIP tower, which the planner counted before).
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
    mrope_interleaved: bool = False
    default_mrope_section: tuple[int, ...] | None = None
    hooks: str | None = None
    vision_model_types: tuple[str, ...] = ()

    def family_hooks(self):
        """The family's ``FamilyHooks`` instance (one per class, imported on first use)."""
        return _hooks_instance(self.hooks or "atlas_vlm.models.family_hooks:FamilyHooks")


_QWEN_VL = dict(nested_text_config=True, multimodal=True, mrope=True, modalities=("image", "video"))
_Q2 = "atlas_vlm.models.qwen2_vl"
_Q3 = "atlas_vlm.models.qwen3_vl"
_Q35 = "atlas_vlm.models.qwen3_5"
_SMOL = "atlas_vlm.models.smolvlm"
_DEFAULT_VISION_HOOKS = f"{_Q2}.family:QwenVLHooks"  # registry.vision_hooks: a tower no family names

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), ("llama",)),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qkv_bias=None, qk_norm=True),
    ModelFamily("qwen2_vl", ("Qwen2VLForConditionalGeneration",), ("qwen2_vl",), qkv_bias=True,
                vision_tower=f"{_Q2}.vision:VisionEncoder", mm_inputs=f"{_Q2}.inputs:Qwen2VLInputs",
                hooks=f"{_Q2}.family:Qwen2VLHooks", vision_model_types=("qwen2_vl", "qwen2_vl_vision"), **_QWEN_VL),
    ModelFamily("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), ("qwen2_5_vl",), qkv_bias=True,
                vision_tower=f"{_Q2}.vision:VisionEncoder", mm_inputs=f"{_Q2}.inputs:Qwen2_5_VLInputs",
                hooks=f"{_Q2}.family:Qwen2_5_VLHooks", vision_model_types=("qwen2_5_vl", "qwen2_5_vl_vision"),
                **_QWEN_VL),
    ModelFamily("qwen3_vl", ("Qwen3VLForConditionalGeneration",), ("qwen3_vl",),
                model_cls=f"{_Q3}.model:Qwen3VLForCausalLM", qkv_bias=None, qk_norm=True,
                vision_tower=f"{_Q3}.vision:Qwen3VLVisionEncoder", mm_inputs=f"{_Q3}.inputs:Qwen3VLInputs",
                hooks=f"{_Q3}.family:Qwen3VLHooks", vision_model_types=("qwen3_vl", "qwen3_vl_vision"),
                mrope_interleaved=True, default_mrope_section=(24, 20, 20),  # HF Qwen3VLTextRotaryEmbedding
                **_QWEN_VL),
    # Qwen3.5: hybrid (Gated DeltaNet + gated attention), Qwen3-VL's tower without DeepStack and
    # Qwen3-VL's media inputs; the text-only Qwen3_5ForCausalLM checkpoint (a qwen3_5_text config,
    # no vision_config) is its own line: the same decoder, no tower, no processor settings.
    ModelFamily("qwen3_5", ("Qwen3_5ForConditionalGeneration",), ("qwen3_5",),
                model_cls=f"{_Q35}.model:Qwen3_5ForCausalLM", vision_tower=f"{_Q35}.vision:Qwen3_5VisionEncoder",
                mm_inputs=f"{_Q3}.inputs:Qwen3VLInputs", hooks=f"{_Q35}.family:Qwen3_5Hooks",
                vision_model_types=("qwen3_5", "qwen3_5_vision"), mrope_interleaved=True,
                default_mrope_section=(11, 11, 10), **_QWEN_VL),  # HF Qwen3_5TextRotaryEmbedding
    ModelFamily("qwen3_5_text", ("Qwen3_5ForCausalLM",), ("qwen3_5_text",), model_cls=f"{_Q35}.model:Qwen3_5ForCausalLM",
                hooks=f"{_Q35}.family:Qwen3_5TextHooks", nested_text_config=True, mrope=True,
                mrope_interleaved=True, default_mrope_section=(11, 11, 10)),
    ModelFamily("smolvlm", ("SmolVLMForConditionalGeneration",), ("smolvlm",),
                nested_text_config=True, qkv_bias=None, multimodal=True, modalities=("image", "video"),
                mm_inputs=f"{_SMOL}.inputs:SmolVLMInputs", vision_tower=f"{_SMOL}.vision:SmolVLMVisionEncoder",
                hooks=f"{_SMOL}.family:SmolVLMHooks", vision_model_types=("smolvlm_vision", "idefics3_vision")),
)

SUPPORTED_ARCHITECTURES: dict[str, str] = {a: f.name for f in FAMILIES for a in f.architectures}
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_VISION_TYPE = {t: f for f in FAMILIES for t in f.vision_model_types}


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


def find_family(hf_config, *, by_parts: bool = True) -> ModelFamily | None:
    """The family of a config, leniently, for formulas that run on any config (the planner,
    the parameter counts, the image settings); None when nothing matches.

    Order: ``resolve_family``; then the config's ``model_type`` alone (``architectures``
    naming something else); with ``by_parts``, then its decoder config's ``model_type`` less
    a ``_text`` suffix (a text config given alone, e.g. ``qwen2_5_vl_text``), then its
    ``vision_config.model_type`` against each family's ``vision_model_types``.
    """
    try:
        return resolve_family(hf_config)
    except UnsupportedModelError:
        pass
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    if not by_parts:
        return None
    text_type = str(model_type or "").removesuffix("_text")
    if text_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[text_type]
    vision_type = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
    return _BY_VISION_TYPE.get(vision_type)


def vision_hooks(hf_config):
    """The ``FamilyHooks`` that size ``hf_config``'s vision tower for the planner: its family's
    (``find_family``); a config no vision family matches is sized by the Qwen-VL geometry
    (``qwen2_vl.family.QwenVLHooks``), the rule the planner applied to every tower but SigLIP."""
    family = find_family(hf_config)
    return family.family_hooks() if family is not None and family.hooks else _hooks_instance(_DEFAULT_VISION_HOOKS)


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


@functools.cache
def _hooks_instance(path: str):
    return import_named(path)()
