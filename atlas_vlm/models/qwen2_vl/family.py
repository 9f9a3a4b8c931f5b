"""Qwen2-VL / Qwen2.5-VL hooks (``ModelFamily.hooks``): released image-processor defaults,
the towers' parameter counts, and the qwen-vl-utils geometry the planner sizes images and
videos by (``QwenVLHooks``, which Qwen3-VL's hooks extend).
"""

from __future__ import annotations

from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from atlas_vlm.models.family_hooks import FamilyHooks
from atlas_vlm.models.family_hooks import linear_params as _linear

__all__ = ["QwenVLHooks", "Qwen2VLHooks", "Qwen2_5_VLHooks", "QWEN2_VL_PROCESSOR_DEFAULTS"]

#: Qwen2-VL / Qwen2.5-VL released ``preprocessor_config.json``: ``min_pixels`` 3136,
#: ``max_pixels`` 12845056, OpenAI CLIP mean / std.
QWEN2_VL_PROCESSOR_DEFAULTS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, image_mean=tuple(OPENAI_CLIP_MEAN),
                                   image_std=tuple(OPENAI_CLIP_STD))


class QwenVLHooks(FamilyHooks):
    """The Qwen-VL geometry: patches of ``patch_size``, merged ``spatial_merge_size`` squared
    into one token (qwen-vl-utils ``smart_resize``); also the planner's rule for a tower no
    family names (``registry.vision_hooks``)."""

    def vision_width(self, v) -> tuple[int, int]:
        """``(d, I)``: the tower's width and MLP width."""
        return v.hidden_size, v.intermediate_size

    def vision_activation_shape(self, hf_config, max_pixels: int) -> tuple[int, int, int]:
        v = hf_config.vision_config
        d, inter = self.vision_width(v)
        return max_pixels // v.patch_size**2, d, inter

    def visual_tokens_per_image(self, hf_config, max_pixels: int) -> int:
        """``max_pixels // (patch_size * spatial_merge_size)**2`` (``smart_resize`` keeps
        ``h * w <= max_pixels`` on multiples of that factor)."""
        v = hf_config.vision_config
        return max_pixels // (v.patch_size * v.spatial_merge_size) ** 2

    def largest_image_pixels(self, hf_config, max_tokens: int) -> int:
        """``max_tokens * (patch_size * spatial_merge_size)**2`` (a multiple of the patch area)."""
        v = hf_config.vision_config
        return max(0, max_tokens) * (v.patch_size * v.spatial_merge_size) ** 2

    def video_tokens_per_clip(self, hf_config, seconds: float, video_sampling: dict | None, *, fps, max_frames,
                              nframes) -> tuple[int, int, int]:
        """qwen-vl-utils 0.0.14 sampling of a 30 fps source, each frame at most
        ``video_frame_bounds(...).max_pixels``."""
        from mm_token_pipeline import sample_frame_indices, video_frame_bounds

        v = hf_config.vision_config
        frames = sample_frame_indices(max(1, int(round(seconds * 30))), 30.0, fps=fps, nframes=nframes,
                                      max_frames=max_frames).nframes
        bounds = video_frame_bounds(frames, patch_size=v.patch_size, merge_size=v.spatial_merge_size)
        per_group = int(bounds.max_pixels) // (v.patch_size * v.spatial_merge_size) ** 2
        return frames, int(bounds.max_pixels), frames // v.temporal_patch_size * per_group


class Qwen2VLHooks(QwenVLHooks):
    """Qwen2-VL: ``Qwen2VisionTransformerPretrainedModel`` (LayerNorms, fc1/fc2 MLP of
    ``embed_dim * mlp_ratio``)."""

    processor_defaults = QWEN2_VL_PROCESSOR_DEFAULTS

    def vision_width(self, v) -> tuple[int, int]:
        return v.embed_dim, int(v.embed_dim * v.mlp_ratio)

    def vision_params(self, hf_config) -> int:
        """Patch embed (Conv3d, no bias), blocks, patch merger (modeling_qwen2_vl)."""
        v = hf_config.vision_config
        d, inter = self.vision_width(v)
        m2 = v.spatial_merge_size**2
        patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * d
        block = 2 * 2 * d + _linear(d, 3 * d) + _linear(d, d) + _linear(d, inter) + _linear(inter, d)  # LayerNorms
        merger = 2 * d + _linear(d * m2, d * m2) + _linear(d * m2, v.hidden_size)
        return patch + v.depth * block + merger


class Qwen2_5_VLHooks(QwenVLHooks):
    """Qwen2.5-VL: ``Qwen2_5_VisionTransformerPretrainedModel`` (RMSNorms, gated MLP)."""

    processor_defaults = QWEN2_VL_PROCESSOR_DEFAULTS

    def vision_params(self, hf_config) -> int:
        """Patch embed (Conv3d, no bias), blocks, patch merger (modeling_qwen2_5_vl)."""
        v = hf_config.vision_config
        d, inter = self.vision_width(v)
        m2 = v.spatial_merge_size**2
        patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * d
        block = 2 * d + _linear(d, 3 * d) + _linear(d, d) + 2 * _linear(d, inter) + _linear(inter, d)  # RMSNorms, gated
        merger = d + _linear(d * m2, d * m2) + _linear(d * m2, v.out_hidden_size)
        return patch + v.depth * block + merger
