"""Qwen3.5 hooks (``ModelFamily.hooks``): the hybrid decoder's parameter count, and for the
VLM the tower's (Qwen3-VL's modules without the DeepStack mergers, HF 5.25
``Qwen3_5VisionModel``); image-processor defaults as the released
``preprocessor_config.json`` (patch 16, merge 2, 65536..16777216 pixels, mean = std = 0.5:
the same values as Qwen3-VL's; ``atlas_vlm/data/configs/Qwen3.5-*``).
"""

from __future__ import annotations

from atlas_vlm.models.family_hooks import FamilyHooks
from atlas_vlm.models.qwen3_5.param_count import qwen3_5_text_params
from atlas_vlm.models.qwen3_vl.family import Qwen3VLHooks

__all__ = ["Qwen3_5Hooks", "Qwen3_5TextHooks"]


def _text_params(hf_config) -> int:
    return qwen3_5_text_params(hf_config.get_text_config(decoder=True),
                               bool(getattr(hf_config, "tie_word_embeddings", False)))


class Qwen3_5TextHooks(FamilyHooks):
    """A text-only ``Qwen3_5ForCausalLM`` checkpoint: the hybrid decoder's count, no tower."""

    def text_params(self, hf_config) -> int:
        """``models.qwen3_5.param_count.qwen3_5_text_params`` of the text config."""
        return _text_params(hf_config)


class Qwen3_5Hooks(Qwen3VLHooks):
    """``Qwen3_5ForConditionalGeneration``: Qwen3-VL's tower geometry and processor defaults
    (its ``vision_params`` counts no DeepStack merger: Qwen3.5's config has no
    ``deepstack_visual_indexes``), the hybrid decoder's count."""

    def text_params(self, hf_config) -> int:
        """``models.qwen3_5.param_count.qwen3_5_text_params`` of the text config."""
        return _text_params(hf_config)
