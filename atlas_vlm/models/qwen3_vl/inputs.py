"""Qwen3-VL media inputs (``ModelFamily.mm_inputs``): Qwen-VL's, with its chat template,
``'<t seconds>'`` timestamps per video frame group, and HF ``Qwen3VLModel.get_rope_index``
for prompts with videos (grids split per temporal group).
"""

from __future__ import annotations

import torch

from atlas_vlm.models.qwen2_vl.inputs import QwenVLInputs
from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_CHAT_TEMPLATE

__all__ = ["Qwen3VLInputs"]


class Qwen3VLInputs(QwenVLInputs):
    """Qwen3-VL: :data:`QWEN3_VL_CHAT_TEMPLATE` by default, timestamps in video prompts."""

    default_chat_template = QWEN3_VL_CHAT_TEMPLATE
    video_timestamps = True

    def video_positions(self, ids: list[int], images: list, videos: list, common: dict) -> tuple[torch.Tensor, int]:
        """``get_rope_index_qwen3_vl``: every temporal group of a video its own grid."""
        from atlas_vlm.models.qwen3_vl.mrope import get_rope_index_qwen3_vl

        return get_rope_index_qwen3_vl(ids, images, [v.grid_thw for v in videos],
                                       video_token_id=self.hf_config.video_token_id, **common)
