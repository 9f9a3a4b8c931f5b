"""Qwen3-VL hooks (``ModelFamily.hooks``): released image-processor defaults (patch 16,
mean = std = 0.5) and the tower's parameter count; the geometry is Qwen-VL's.
"""

from __future__ import annotations

from atlas_vlm.models.family_hooks import linear_params as _linear
from atlas_vlm.models.qwen2_vl.family import QwenVLHooks

__all__ = ["Qwen3VLHooks", "QWEN3_VL_PROCESSOR_DEFAULTS"]

#: Qwen3-VL released ``preprocessor_config.json``: ``size`` ``{shortest_edge: 65536,
#: longest_edge: 16777216}``, mean = std = 0.5.
QWEN3_VL_PROCESSOR_DEFAULTS = dict(min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5),
                                   image_std=(0.5, 0.5, 0.5))


class Qwen3VLHooks(QwenVLHooks):
    """Qwen3-VL: ``Qwen3VLVisionModel`` (learned position embeddings, DeepStack mergers)."""

    processor_defaults = QWEN3_VL_PROCESSOR_DEFAULTS

    def vision_params(self, hf_config) -> int:
        """Patch embed (Conv3d with bias), position embeddings, blocks, merger and one
        DeepStack merger per ``deepstack_visual_indexes`` entry (modeling_qwen3_vl)."""
        v = hf_config.vision_config
        d, inter = self.vision_width(v)
        m2 = v.spatial_merge_size**2
        patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * d + d  # Conv3d with bias
        pos = v.num_position_embeddings * d
        block = 2 * 2 * d + _linear(d, 3 * d) + _linear(d, d) + _linear(d, inter) + _linear(inter, d)
        fcs = _linear(d * m2, d * m2) + _linear(d * m2, v.out_hidden_size)
        merger = 2 * d + fcs  # LayerNorm before the 2x2 shuffle
        taps = len(getattr(v, "deepstack_visual_indexes", None) or ())  # Qwen3.5's tower: none
        deepstack = taps * (2 * d * m2 + fcs)  # LayerNorm after the shuffle
        return patch + pos + v.depth * block + merger + deepstack
