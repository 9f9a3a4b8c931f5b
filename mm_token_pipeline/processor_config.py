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

from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

__all__ = ["ImageProcessorSettings", "image_processor_settings", "RELEASED_DEFAULTS"]

#: What the released checkpoints' ``preprocessor_config.json`` say, per ``model_type``
#: (Qwen2-VL / Qwen2.5-VL: ``min_pixels`` 3136, ``max_pixels`` 12845056; Qwen3-VL:
#: ``size`` ``{shortest_edge: 65536, longest_edge: 16777216}``, mean = std = 0.5; Qwen3.5 ships the
#: same values: ``Qwen2VLImageProcessorFast``, patch 16, merge 2, as the family's published
#: preprocessor_config.json, e.g. the Qwen3.6-27B copy in GitHub hualayn/ai-articles).
RELEASED_DEFAULTS: dict[str, dict] = {
    "qwen2_vl": dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, image_mean=tuple(OPENAI_CLIP_MEAN),
                     image_std=tuple(OPENAI_CLIP_STD)),
    "qwen2_5_vl": dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, image_mean=tuple(OPENAI_CLIP_MEAN),
                       image_std=tuple(OPENAI_CLIP_STD)),
    "qwen3_vl": dict(min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)),
    "qwen3_5": dict(min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)),
}


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

    Args:
        model_dir: the model folder (may be None or lack ``preprocessor_config.json``: the
            released defaults of ``hf_config.model_type`` are used then).
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
    if model_type == "smolvlm":
        return _smolvlm_settings(path if has_file else None, vision)
    if model_type not in RELEASED_DEFAULTS:
        raise ValueError(f"no image-processor defaults for model_type {model_type!r}")
    geometry = dict(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                    temporal_patch_size=vision.temporal_patch_size)
    values = {**RELEASED_DEFAULTS[model_type], **geometry}
    source = f"released {model_type} defaults (no preprocessor_config.json)"
    if has_file:
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


def _smolvlm_settings(path: Path | None, vision) -> ImageProcessorSettings:
    """SmolVLM: the bound is ``size["longest_edge"]`` (released: 4 tiles of ``max_image_size``)."""
    tile = vision.image_size
    longest, mean, std = 4 * tile, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    source = "released smolvlm defaults (no preprocessor_config.json)"
    if path is not None:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(path.parent)
        longest = int(proc.size["longest_edge"])
        mean, std = tuple(float(x) for x in proc.image_mean), tuple(float(x) for x in proc.image_std)
        source = str(path)
    return ImageProcessorSettings(min_pixels=1, max_pixels=longest * longest, patch_size=0, merge_size=0,
                                  temporal_patch_size=0, image_mean=mean, image_std=std, source=source,
                                  longest_edge=longest)

