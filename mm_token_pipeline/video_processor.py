"""From decoded video frames to vision-tower inputs: ``preprocess_video`` and ``ProcessedVideo``.

Scope (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): resize every frame once as qwen-vl-utils 0.0.14
``fetch_video`` does (its per-frame bounds under ``total_pixels``: ``video_resized_size``;
torchvision ``resize(BICUBIC, antialias=True)`` on uint8 frames, which is
``torch.nn.functional.interpolate(mode="bicubic", antialias=True)`` on float32, clamped to
0..255 and rounded back to uint8, called here directly), then rescale, normalise and patchify
with HF transformers' ``Qwen2VLVideoProcessor(do_resize=False, do_sample_frames=False)``
(its ``patchify`` is the same as ``Qwen3VLVideoProcessor``'s). Also the temporal metadata the
prompt and the M-RoPE positions need: ``second_per_grid_t`` (HF ``Qwen2_5_VLProcessor``) and
per-group ``timestamps`` (HF ``Qwen3VLProcessor._calculate_timestamps``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np
import torch
from transformers import Qwen2VLVideoProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from .video_io import VideoFrames
from .video_sampling import VideoInputError, video_resized_size

__all__ = ["ProcessedVideo", "preprocess_video", "resize_frames", "video_timestamps", "UNKNOWN_FPS"]

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


@lru_cache(maxsize=16)
def _hf_processor(patch_size, merge_size, temporal_patch_size, mean, std) -> Qwen2VLVideoProcessor:
    """A cached HF video processor that only rescales, normalises and patchifies."""
    return Qwen2VLVideoProcessor(
        do_resize=False, do_sample_frames=False, do_rescale=True, do_normalize=True, do_convert_rgb=True,
        image_mean=list(mean), image_std=list(std), patch_size=patch_size, merge_size=merge_size,
        temporal_patch_size=temporal_patch_size, cap_pixels_per_frame=False,
    )


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


def _content_hash(video: VideoFrames, resized_hw: tuple[int, int]) -> str:
    digest = hashlib.sha256()
    head = (f"video:{video.frames.shape}:{video.frame_indices}:fps={video.fps!r}:sample_fps={video.sample_fps!r}"
            f"->{resized_hw[0]}x{resized_hw[1]}")
    digest.update(head.encode())
    digest.update(np.ascontiguousarray(video.frames).tobytes())
    return digest.hexdigest()


def preprocess_video(
    video: VideoFrames,
    *,
    min_pixels: float | None = None,
    max_pixels: float | None = None,
    total_pixels: float | None = None,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    image_mean: tuple[float, ...] = tuple(OPENAI_CLIP_MEAN),
    image_std: tuple[float, ...] = tuple(OPENAI_CLIP_STD),
    source: str | None = None,
) -> ProcessedVideo:
    """Resize the frames of one video and turn them into patches for the vision tower.

    Args:
        video: :class:`VideoFrames` from :func:`load_video` (uint8 ``[T, H, W, 3]``).
        min_pixels, max_pixels, total_pixels: the item's per-frame / whole-video pixel bounds
            (``None``: qwen-vl-utils' defaults; see :func:`video_frame_bounds`).
        patch_size, merge_size, temporal_patch_size: tower geometry (Qwen2/2.5-VL: 14, 2, 2;
            Qwen3-VL: 16, 2, 2).
        image_mean, image_std: per-channel normalisation (OpenAI CLIP; Qwen3-VL: 0.5, 0.5).
        source: name used in errors (default: the video's own source).

    Returns:
        :class:`ProcessedVideo`; features and grid equal to qwen-vl-utils ``fetch_video`` and
        the HF Qwen2-VL / Qwen2.5-VL / Qwen3-VL video processor on the same frames.

    Raises:
        VideoInputError: not a :class:`VideoFrames`, frames not uint8 ``[T, H, W, 3]``, bad
            pixel bounds or an aspect ratio over 200 (from :func:`video_resized_size`).
        ValueError: the processor's grid disagrees with the resize (a bug, never accepted).
    """
    if not isinstance(video, VideoFrames):
        raise VideoInputError(source or type(video).__name__,
                              f"preprocess_video needs VideoFrames (use load_video), got {type(video).__name__}")
    source = source or video.source
    frames = video.frames
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 \
            or frames.shape[0] < 1:
        raise VideoInputError(source, f"frames must be uint8 [T>=1, H, W, 3], got {getattr(frames, 'dtype', '?')} "
                                      f"{tuple(getattr(frames, 'shape', ()))}")
    t, h, w = frames.shape[:3]
    rh, rw = video_resized_size(h, w, t, patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels,
                                max_pixels=max_pixels, total_pixels=total_pixels, source=source)
    resized = resize_frames(frames, (rh, rw))  # [T, 3, rh, rw] float32, as qwen-vl-utils returns it
    proc = _hf_processor(patch_size, merge_size, temporal_patch_size, tuple(image_mean), tuple(image_std))
    out = proc(videos=[resized], return_tensors="pt", input_data_format="channels_first")
    grid = tuple(int(x) for x in out["video_grid_thw"][0].tolist())
    expected = (-(-t // temporal_patch_size), rh // patch_size, rw // patch_size)
    if grid != expected:
        raise ValueError(f"{source}: video processor grid {grid} != resize grid {expected}")
    sample_fps = float(video.sample_fps) if video.sample_fps is not None else UNKNOWN_FPS
    gt, gh, gw = grid
    return ProcessedVideo(
        pixel_values=out["pixel_values_videos"].to(torch.float32),
        grid_thw=grid,
        num_tokens=gt * gh * gw // merge_size**2,
        content_hash=_content_hash(video, (rh, rw)),
        resized_hw=(rh, rw),
        second_per_grid_t=temporal_patch_size / sample_fps,
        timestamps=video_timestamps(video.frame_indices, video.fps, temporal_patch_size),
        sample_fps=sample_fps,
        frame_indices=video.frame_indices,
        source=source,
    )
