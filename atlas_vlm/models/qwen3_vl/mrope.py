"""Qwen3-VL's M-RoPE positions (HF ``Qwen3VLModel.get_rope_index``): the shared rule of
``mm_token_pipeline.mrope`` with each video grid split per temporal group.

Images follow Qwen2.5-VL's rule; a video grid ``(t, h, w)`` becomes ``t`` grids ``(1, h, w)``,
one per timestamped run of the prompt (``build_prompt_ids(..., video_timestamps=True)``), each
with interval 1. Qwen3.5 takes the same positions (its registry line names Qwen3-VL's inputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mm_token_pipeline.mrope import grid_rows, run_positions

__all__ = ["get_rope_index_qwen3_vl"]


def get_rope_index_qwen3_vl(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None = None,
    video_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
) -> tuple[torch.Tensor, int]:
    """Qwen3-VL's M-RoPE positions ``[3, N]`` and ``rope_delta`` (HF ``Qwen3VLModel.get_rope_index``).

    Each video grid ``(t, h, w)`` becomes ``t`` grids ``(1, h, w)``, one per timestamped run
    ``<t seconds><|vision_start|>pads<|vision_end|>`` of ``build_prompt_ids(...,
    video_timestamps=True)``; the timestamp text is ordinary text. Images as ``mm_token_pipeline.get_rope_index``.

    Raises:
        ValueError: as ``get_rope_index``; grid counts are per frame for videos.
    """
    frames = [(1, h, w) for t, h, w in grid_rows(video_grid_thw, "video_grid_thw") for _ in range(t)]
    return run_positions(input_ids, {image_token_id: "image", video_token_id: "video"},
                         {"image": grid_rows(image_grid_thw, "image_grid_thw"), "video": frames}, [1] * len(frames),
                         spatial_merge_size, vision_start_token_id)
