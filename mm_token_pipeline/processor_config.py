"""The checkpoint's own image-processor settings: the one source of every default image bound.

``image_processor_settings(model_dir, hf_config)`` reads the model folder's
``preprocessor_config.json`` as transformers' ``AutoImageProcessor`` reads it
(``size.shortest_edge`` / ``size.longest_edge``, the older ``min_pixels`` / ``max_pixels``,
``patch_size``, ``merge_size``, ``temporal_patch_size``, ``image_mean`` / ``image_std``; for
SmolVLM ``size.longest_edge`` and ``max_image_size``). Where the folder has no such file, the
values of the family's released checkpoints stand in, and ``source`` says so. The engine
(prompts, the KV reserve for the vision tower) and ``atlas-vlm plan`` both start from these
settings; engine options, then request options, then per-item options override them, in
that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ImageProcessorSettings", "image_processor_settings", "settings_from_processor"]

@dataclass(frozen=True)
class ImageProcessorSettings:
    """A checkpoint's image geometry and default bounds.

    Attributes:
        min_pixels, max_pixels: default area bounds of a resized image, in pixels (Qwen's
            ``smart_resize``). SmolVLM: ``max_pixels = longest_edge**2`` (its processor
            bounds the longest edge) and ``min_pixels = 1``.
        patch_size, merge_size, temporal_patch_size: the tower's patch geometry (pixels,
            patches, frames); SmolVLM: its tile side in ``patch_size`` is unused (0s).
        image_mean, image_std: per-channel normalisation.
        longest_edge: SmolVLM's ``size["longest_edge"]`` in pixels (None for Qwen).
        source: where the values came from: ``"<folder>/preprocessor_config.json"`` or
            ``"released <model_type> defaults (no preprocessor_config.json)"``.
    """

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    source: str
    longest_edge: int | None = None

    def preprocess_kwargs(self) -> dict:
        """Keyword arguments of ``preprocess_image`` for the geometry and normalisation."""
        return dict(patch_size=self.patch_size, merge_size=self.merge_size,
                    temporal_patch_size=self.temporal_patch_size, image_mean=self.image_mean,
                    image_std=self.image_std)


def image_processor_settings(model_dir: Path | str | None, hf_config) -> ImageProcessorSettings | None:
    """The image settings of the checkpoint in ``model_dir`` (None for a text-only model).

    The family's hooks read them (``FamilyHooks.image_processor_settings``: Qwen families
    through :func:`settings_from_processor`, SmolVLM its longest edge); the family is found
    by ``atlas_vlm.models.registry.find_family`` (imported here on first use: this package
    imports no ``atlas_vlm`` module at import time).

    Args:
        model_dir: the model folder (may be None or lack ``preprocessor_config.json``: the
            released defaults of the family are used then).
        hf_config: its transformers config (``vision_config`` gives the patch geometry where
            the processor config has none).

    Raises:
        ValueError: the processor's patch geometry disagrees with the vision tower's config,
            its bounds are not ``0 < min <= max``, or the family has no known defaults.
    """
    from atlas_vlm.models.registry import find_family

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


def settings_from_processor(path: Path | None, vision, released: dict, label: str) -> ImageProcessorSettings:
    """Qwen-style settings: ``released`` (the family's released defaults: ``min_pixels``,
    ``max_pixels``, ``image_mean``, ``image_std``) with the tower's patch geometry, overridden
    by ``path`` (a ``preprocessor_config.json``, read by ``AutoImageProcessor``) when given.

    Raises:
        ValueError: the file's patch geometry disagrees with the tower's, or its bounds are
            not ``0 < min <= max``.
    """
    geometry = dict(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                    temporal_patch_size=vision.temporal_patch_size)
    values = {**released, **geometry}
    source = f"released {label} defaults (no preprocessor_config.json)"
    if path is not None:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(path.parent)
        size = proc.size
        values.update(min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
                      image_mean=tuple(float(x) for x in proc.image_mean),
                      image_std=tuple(float(x) for x in proc.image_std))
        for name, ours in geometry.items():
            theirs = getattr(proc, name, None)
            if theirs is not None and int(theirs) != int(ours):
                raise ValueError(f"{path}: {name} {theirs} disagrees with the vision tower's "
                                 f"{'spatial_merge_size' if name == 'merge_size' else name} {ours}")
        source = str(path)
    if not 0 < values["min_pixels"] <= values["max_pixels"]:
        raise ValueError(f"{source}: need 0 < min_pixels <= max_pixels, got {values['min_pixels']} and "
                         f"{values['max_pixels']}")
    return ImageProcessorSettings(source=source, **values)
