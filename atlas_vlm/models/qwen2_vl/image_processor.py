"""The Qwen-VL image processor: from an RGB image to vision-tower inputs (``preprocess_image``).

Scope: resize once with the shared ``smart_resize`` (Pillow bicubic, as qwen-vl-utils
``fetch_image`` does), then patchify and normalise the already-resized image with HF
transformers' ``Qwen2VLImageProcessor(do_resize=False)``, so the token count and the features
come from the same resize. Qwen2-VL / Qwen2.5-VL (patch 14), Qwen3-VL and Qwen3.5 (patch 16,
their own mean / std) differ only in the geometry passed (``ImageProcessorSettings``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from mm_token_pipeline.processor import ProcessedImage, content_hash
from mm_token_pipeline.resize import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, smart_resize

__all__ = ["preprocess_image"]


@lru_cache(maxsize=16)
def _hf_processor(patch_size, merge_size, temporal_patch_size, mean, std) -> Qwen2VLImageProcessor:
    """A cached HF processor that only rescales, normalises and patchifies (no resize)."""
    return Qwen2VLImageProcessor(
        do_resize=False, do_rescale=True, do_normalize=True, do_convert_rgb=True,
        image_mean=list(mean), image_std=list(std), patch_size=patch_size,
        merge_size=merge_size, temporal_patch_size=temporal_patch_size,
    )


def preprocess_image(
    image: Image.Image,
    *,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    image_mean: tuple[float, ...] = tuple(OPENAI_CLIP_MEAN),
    image_std: tuple[float, ...] = tuple(OPENAI_CLIP_STD),
    source: str = "image",
) -> ProcessedImage:
    """Resize one RGB image and turn it into patches for the vision tower.

    Args:
        image: an RGB ``PIL.Image`` (from ``mm_token_pipeline.load_image``), any size w x h in pixels.
        min_pixels, max_pixels: area bounds in pixels passed to ``mm_token_pipeline.smart_resize``;
            the image yields at most ``max_pixels // (patch_size*merge_size)**2`` tokens.
        patch_size, merge_size, temporal_patch_size: vision tower geometry (Qwen2.5-VL: 14, 2, 2).
        image_mean, image_std: per-channel normalisation (OpenAI CLIP, as Qwen2VLImageProcessor).
        source: name used in error messages.

    Returns:
        ProcessedImage with ``pixel_values`` ``[t*h*w, 3*temporal_patch_size*patch_size**2]``.

    Raises:
        ValueError: the image is not RGB (call ``load_image`` first), or the processor's
            grid disagrees with the resize (a bug, never silently accepted).
        ImageInputError: aspect ratio over 200 (from ``smart_resize``).
    """
    if not isinstance(image, Image.Image) or image.mode != "RGB":
        got = image.mode if isinstance(image, Image.Image) else type(image).__name__
        raise ValueError(f"{source}: preprocess_image needs an RGB PIL.Image (use load_image), got {got}")
    factor = patch_size * merge_size
    rh, rw = smart_resize(image.height, image.width, factor=factor,
                          min_pixels=min_pixels, max_pixels=max_pixels, source=source)
    resized = image.resize((rw, rh), resample=Image.Resampling.BICUBIC)
    proc = _hf_processor(patch_size, merge_size, temporal_patch_size, tuple(image_mean), tuple(image_std))
    out = proc(images=[resized], return_tensors="pt", input_data_format="channels_last")  # never guessed from the shape
    grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
    expected = (1, rh // patch_size, rw // patch_size)
    if grid != expected:
        raise ValueError(f"{source}: processor grid {grid} != resize grid {expected}")
    pixel_values = out["pixel_values"].to(torch.float32)  # [t*h*w, 3*tps*ps*ps]
    t, h, w = grid
    return ProcessedImage(
        pixel_values=pixel_values,
        grid_thw=grid,
        num_tokens=t * h * w // merge_size**2,
        content_hash=content_hash(image, (rh, rw)),
        resized_hw=(rh, rw),
    )
