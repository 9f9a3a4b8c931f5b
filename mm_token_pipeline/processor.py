"""A patchified image ready for a vision tower (``ProcessedImage``) and the content hash that
identifies it for prefix caching and the encoder cache (``content_hash``): what every family's
image processor returns. The Qwen-VL processor that makes them is
``atlas_vlm.models.qwen2_vl.image_processor.preprocess_image``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from PIL import Image

__all__ = ["ProcessedImage", "content_hash"]


@dataclass
class ProcessedImage:
    """One image ready for the vision tower.

    Attributes:
        pixel_values: ``[num_patches, C * temporal_patch_size * patch_size**2]`` float32
            (``[t*h*w, 3*2*14*14 = 1176]`` by default), rows in the order of HF's
            ``Qwen2VLImageProcessor`` (merge-window major).
        grid_thw: ``(t, h, w)`` in patches of ``patch_size`` (14) pixels.
        num_tokens: ``t*h*w // merge_size**2``, the number of ``<|image_pad|>`` tokens.
        content_hash: sha256 hex of the loaded RGB pixels (before resize), their size and
            the resized size; identifies the image for prefix caching.
        resized_hw: ``(height, width)`` in pixels after ``smart_resize``.
        modality: ``"image"`` (class attribute; ``ProcessedVideo.modality`` is ``"video"``).
    """

    modality: ClassVar[str] = "image"

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    content_hash: str
    resized_hw: tuple[int, int]


def content_hash(image: Image.Image, resized_hw: tuple[int, int]) -> str:
    """sha256 hex of an RGB image's size, pixel bytes and target ``(h, w)`` in pixels."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.width}x{image.height}->{resized_hw[0]}x{resized_hw[1]}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
