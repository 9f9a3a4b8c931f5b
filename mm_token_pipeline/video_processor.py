"""A processed video ready for a vision tower (``ProcessedVideo``) and the shared steps that make
one: the frame resize qwen-vl-utils 0.0.14 ``fetch_video`` does (``resize_frames``: torchvision
``resize(BICUBIC, antialias=True)`` on uint8 frames, which is
``torch.nn.functional.interpolate(mode="bicubic", antialias=True)`` on float32, clamped to
0..255 and rounded back to uint8, called here directly), the content hash
(``video_content_hash``) and the temporal metadata positions need (per-group ``timestamps``,
HF ``Qwen3VLProcessor._calculate_timestamps``). The Qwen-VL patchify that makes a
``ProcessedVideo`` is ``atlas_vlm.models.qwen2_vl.video_processor.preprocess_video``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .video_io import VideoFrames

__all__ = ["ProcessedVideo", "resize_frames", "video_content_hash", "video_timestamps", "UNKNOWN_FPS"]

#: Frames per second HF's Qwen processors assume when the source fps is unknown
#: (``VideoMetadata.sampled_fps`` and ``Qwen3VLProcessor.replace_video_token``: 24).
UNKNOWN_FPS: float = 24.0


@dataclass
class ProcessedVideo:
    """One video ready for the vision tower (goes through ``VisionEncoder.encode`` as is).

    Attributes:
        pixel_values: ``[grid_t*grid_h*grid_w, C*temporal_patch_size*patch_size**2]`` float32
            (1176 columns for patch 14, 1536 for patch 16), rows in HF's order
            (``pixel_values_videos`` of ``Qwen2VLVideoProcessor``: temporal group major, then
            merge windows).
        grid_thw: ``(grid_t, grid_h, grid_w)`` in patches; ``grid_t = ceil(T / temporal_patch_size)``.
        num_tokens: ``grid_t*grid_h*grid_w // merge_size**2``, all ``<|video_pad|>`` tokens of
            the video in the prompt (Qwen3-VL splits them into ``grid_t`` runs).
        content_hash: sha256 hex of the sampled frames' bytes, their indices, fps, sample fps
            and the resized size (prefix-cache identity).
        resized_hw: ``(height, width)`` in pixels of every resized frame.
        second_per_grid_t: seconds per temporal group, ``temporal_patch_size / sample_fps``
            (HF ``Qwen2_5_VLProcessor`` ``second_per_grid_ts``).
        timestamps: ``grid_t`` floats, seconds of each temporal group from the SOURCE fps:
            the mean of its first and last frame's ``index / fps`` (HF ``Qwen3VLProcessor``).
        sample_fps: frames per second of the sampled video (24 when unknown, as HF).
        frame_indices: source frame index of each sampled frame (T values).
        source: name of the video used in errors.
    """

    modality: ClassVar[str] = "video"

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    content_hash: str
    resized_hw: tuple[int, int]
    second_per_grid_t: float
    timestamps: list[float]
    sample_fps: float
    frame_indices: list[int]
    source: str


def resize_frames(frames: np.ndarray | torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """uint8 RGB frames ``[T, H, W, 3]`` -> float32 ``[T, 3, h, w]`` (values 0..255, integral).

    qwen-vl-utils ``fetch_video``: ``torchvision.transforms.functional.resize(video,
    [h, w], BICUBIC, antialias=True).float()`` on its uint8 ``[T, 3, H, W]`` video; torchvision
    returns the input when the size is unchanged, else interpolates in float32, clamps to
    0..255 and rounds to uint8 (``_functional_tensor.resize``). The same ops, without torchvision.
    """
    video = torch.as_tensor(frames).permute(0, 3, 1, 2)  # [T, 3, H, W] uint8
    if tuple(video.shape[-2:]) != tuple(size_hw):
        video = torch.nn.functional.interpolate(video.float(), size=list(size_hw), mode="bicubic",
                                                align_corners=False, antialias=True)
        video = video.clamp(0, 255).round().to(torch.uint8)
    return video.float().contiguous()


def video_timestamps(frame_indices: list[int], fps: float | None, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal group: HF ``Qwen3VLProcessor._calculate_timestamps``.

    Indices are padded with the last one to a multiple of ``temporal_patch_size``; each
    group's time is ``(first + last) / 2`` of its frames' ``index / fps`` (``fps`` None: 24).
    """
    fps = UNKNOWN_FPS if fps is None else fps
    indices = list(frame_indices)
    if len(indices) % temporal_patch_size:
        indices.extend([indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size))
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_content_hash(video: VideoFrames, resized_hw: tuple[int, int]) -> str:
    digest = hashlib.sha256()
    head = (f"video:{video.frames.shape}:{video.frame_indices}:fps={video.fps!r}:sample_fps={video.sample_fps!r}"
            f"->{resized_hw[0]}x{resized_hw[1]}")
    digest.update(head.encode())
    digest.update(np.ascontiguousarray(video.frames).tobytes())
    return digest.hexdigest()
