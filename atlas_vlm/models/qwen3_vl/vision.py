"""Qwen3-VL's part of the token pipeline: image geometry, chat template and vision tower.

Scope: what differs from Qwen2.5-VL. Images are resized with the same qwen-vl-utils
``smart_resize`` rule but with factor 32 (patch 16 x merge 2), so ``max_pixels`` allows at
most ``max_pixels // (32*32)`` visual tokens, and normalised with mean = std = 0.5; bounds,
geometry and normalisation come from the checkpoint's ``preprocessor_config.json``
(``models.processor_settings.image_processor_settings``; released: 65536 / 16777216 pixels); patchify stays
``Qwen2VLImageProcessor(do_resize=False)`` with ``patch_size=16`` given explicitly, so the
slow processor's ignored-``size`` fault (transformers #42910) cannot change the grid.
The vision tower is HF's ``Qwen3VLVisionModel``: it returns the merged features and one
DeepStack feature per ``deepstack_visual_indexes`` entry; :class:`Qwen3VLVisionEncoder`
hands them back side by side in ONE tensor per image, so any slicing by token (chunked
prefill, encoder cache) keeps the DeepStack rows with the main ones.
M-RoPE positions for images follow the same rule as Qwen2.5-VL (HF
``Qwen3VLModel.get_rope_index`` differs only for videos, whose grids it splits per temporal
group): :func:`get_rope_index_qwen3_vl` (``qwen3_vl/mrope.py``, re-exported here) covers both. Video
prompts: ``build_prompt_ids(..., video_timestamps=True)`` with :data:`QWEN3_VL_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from atlas_vlm.models.qwen2_vl.vision import VisionEncoder
from atlas_vlm.models.qwen3_vl.mrope import get_rope_index_qwen3_vl

__all__ = ["QWEN3_VL_CHAT_TEMPLATE", "QWEN3_VL_IMAGE_MEAN", "QWEN3_VL_IMAGE_STD",
           "Qwen3VLVisionEncoder", "get_rope_index_qwen3_vl"]

#: Per-channel mean and std of Qwen3-VL's image processor (its preprocessor_config.json).
QWEN3_VL_IMAGE_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_IMAGE_STD = (0.5, 0.5, 0.5)

#: Qwen3-VL-Instruct chat template, reduced to what the engine uses (no tools): unlike
#: Qwen2.5-VL there is NO default system prompt; one ``<|vision_start|><|image_pad|><|vision_end|>``
#: per image item and, as the released template, one ``<|vision_start|><|video_pad|><|vision_end|>``
#: per video item (``build_prompt_ids(..., video_timestamps=True)`` replaces that whole wrapper
#: with the per-group timestamps and runs, as Qwen's processor and transformers >= 5.25 do).
QWEN3_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Qwen3VLVisionEncoder(VisionEncoder):
    """Qwen3-VL vision tower (HF ``Qwen3VLVisionModel``: patch embed with learned position
    embedding, ViT blocks, 2x2 merger, DeepStack mergers); loading, the grid check and
    ``encode`` are :class:`~atlas_vlm.models.qwen2_vl.vision.VisionEncoder`'s.

    ``encode`` returns per image ``[num_tokens, out_hidden * (1 + K)]``: columns
    ``[0, out_hidden)`` are the merged features that replace the ``<|image_pad|>``
    embeddings, columns ``[(1+k)*out_hidden, (2+k)*out_hidden)`` the DeepStack feature
    added after decoder layer ``k`` (K = ``len(deepstack_visual_indexes)``).
    """

    def __init__(self, vision_config, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
        super().__init__(vision_config, dtype=dtype, attn_implementation=attn_implementation)
        self.num_deepstack = len(self.config.deepstack_visual_indexes)

    @staticmethod
    def _resolve(vision_config):
        if isinstance(vision_config, dict):
            vision_config = Qwen3VLVisionConfig(**vision_config)
        if not isinstance(vision_config, Qwen3VLVisionConfig):
            raise TypeError(f"vision_config must be a Qwen3VLVisionConfig or dict, got {type(vision_config).__name__}")
        return vision_config, Qwen3VLVisionModel

    def _tower(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values, grid_thw=grid)  # transformers 5: BaseModelOutputWithDeepstackFeatures
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)  # [num_tokens, out_hidden * (1 + K)]
