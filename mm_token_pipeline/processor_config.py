"""The checkpoint's own image-processor settings: the one source of every default image bound.

``atlas_vlm.models.processor_settings.image_processor_settings(model_dir, hf_config)`` asks the
family's hooks, which read the model folder's
``preprocessor_config.json`` as transformers' ``AutoImageProcessor`` reads it
(``size.shortest_edge`` / ``size.longest_edge``, the older ``min_pixels`` / ``max_pixels``,
``patch_size``, ``merge_size``, ``temporal_patch_size``, ``image_mean`` / ``image_std``; for
SmolVLM ``size.longest_edge`` and ``max_image_size``). Where the folder has no such file, the
values of the family's released checkpoints stand in, and ``source`` says so. The engine
(prompts, the KV reserve for the vision tower) and ``atlas-vlm plan`` both start from these
settings; engine options, then request options, then per-item options override them, in
that order. This module holds the settings' type and the Qwen-style reader; finding the
family (the model registry) happens above this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ImageProcessorSettings", "settings_from_processor"]

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
