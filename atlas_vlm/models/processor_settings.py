"""A checkpoint's image-processor settings, found through its family (``image_processor_settings``).

The settings' type and the Qwen-style reader live in ``mm_token_pipeline.processor_config``
(family-independent, below ``atlas_vlm``); which family's hooks read a checkpoint is the model
registry's answer, so the entry point sits here, above the registry. The engine (prompts, the KV
reserve for the vision tower), the loader and ``atlas-vlm plan`` all start from it.
"""

from __future__ import annotations

from pathlib import Path

from atlas_vlm.models.registry import find_family
from mm_token_pipeline.processor_config import ImageProcessorSettings

__all__ = ["image_processor_settings"]


def image_processor_settings(model_dir: Path | str | None, hf_config) -> ImageProcessorSettings | None:
    """The image settings of the checkpoint in ``model_dir`` (None for a text-only model).

    The family's hooks read them (``FamilyHooks.image_processor_settings``: Qwen families
    through ``mm_token_pipeline.processor_config.settings_from_processor``, SmolVLM its
    longest edge); the family is found by ``registry.find_family``.

    Args:
        model_dir: the model folder (may be None or lack ``preprocessor_config.json``: the
            released defaults of the family are used then).
        hf_config: its transformers config (``vision_config`` gives the patch geometry where
            the processor config has none).

    Raises:
        ValueError: the processor's patch geometry disagrees with the vision tower's config,
            its bounds are not ``0 < min <= max``, or the family has no known defaults.
    """
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        return None
    model_type = getattr(hf_config, "model_type", None)
    path = Path(model_dir) / "preprocessor_config.json" if model_dir is not None else None
    has_file = path is not None and path.is_file()
    family = find_family(hf_config, by_parts=False)
    if family is None:
        raise ValueError(f"no image-processor defaults for model_type {model_type!r}")
    return family.family_hooks().image_processor_settings(path if has_file else None, hf_config, model_type)
