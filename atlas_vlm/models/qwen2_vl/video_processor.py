"""The Qwen-VL video processor: from decoded video frames to vision-tower inputs (``preprocess_video``).

Scope (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): resize every frame once as qwen-vl-utils
0.0.14 ``fetch_video`` does (its per-frame bounds under ``total_pixels``:
``mm_token_pipeline.video_resized_size``; the shared ``resize_frames``), then rescale,
normalise and patchify with HF transformers' ``Qwen2VLVideoProcessor(do_resize=False,
do_sample_frames=False)`` (its ``patchify`` is the same as ``Qwen3VLVideoProcessor``'s). Also
the temporal metadata the prompt and the M-RoPE positions need: ``second_per_grid_t`` (HF
``Qwen2_5_VLProcessor``) and per-group ``timestamps`` (HF ``Qwen3VLProcessor``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from transformers import Qwen2VLVideoProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from mm_token_pipeline.video_io import VideoFrames
from mm_token_pipeline.video_processor import (UNKNOWN_FPS, ProcessedVideo, resize_frames, video_content_hash,
                                               video_timestamps)
from mm_token_pipeline.video_sampling import VideoInputError, video_resized_size

__all__ = ["preprocess_video"]


@lru_cache(maxsize=16)
def _hf_processor(patch_size, merge_size, temporal_patch_size, mean, std) -> Qwen2VLVideoProcessor:
    """A cached HF video processor that only rescales, normalises and patchifies."""
    return Qwen2VLVideoProcessor(
        do_resize=False, do_sample_frames=False, do_rescale=True, do_normalize=True, do_convert_rgb=True,
        image_mean=list(mean), image_std=list(std), patch_size=patch_size, merge_size=merge_size,
        temporal_patch_size=temporal_patch_size, cap_pixels_per_frame=False,
    )


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
        content_hash=video_content_hash(video, (rh, rw)),
        resized_hw=(rh, rw),
        second_per_grid_t=temporal_patch_size / sample_fps,
        timestamps=video_timestamps(video.frame_indices, video.fps, temporal_patch_size),
        sample_fps=sample_fps,
        frame_indices=video.frame_indices,
        source=source,
    )
