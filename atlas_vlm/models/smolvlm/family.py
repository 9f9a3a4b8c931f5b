"""SmolVLM2 hooks (``ModelFamily.hooks``): its image settings (a longest-edge bound), the
SigLIP tower + connector's parameter count, and the Idefics3 processor's tiling the planner
sizes images and videos by.
"""

from __future__ import annotations

import math

from atlas_vlm.models.family_hooks import FamilyHooks, text_config
from atlas_vlm.models.family_hooks import linear_params as _linear

__all__ = ["SmolVLMHooks"]


def _tiles(hf_config, max_pixels: int) -> tuple[int, int, int]:
    """(tiles incl. the global view, patches per tile, tile side in pixels)."""
    v = hf_config.vision_config
    tile = (getattr(v, "max_image_size", None) or {}).get("longest_edge", v.image_size)
    longest = (getattr(v, "size", None) or {}).get("longest_edge", 4 * tile)
    side = min(math.isqrt(max_pixels), longest)
    n = math.ceil(side / tile)
    return n * n + (1 if n > 1 else 0), (v.image_size // v.patch_size) ** 2, tile


class SmolVLMHooks(FamilyHooks):
    """SmolVLM2 / Idefics3 processor geometry: a square of side ``min(sqrt(max_pixels),
    size.longest_edge)`` cut into ``ceil(side / tile)**2`` tiles of ``tile =
    max_image_size.longest_edge`` pixels plus one global view when there is more than one;
    each tile gives ``(image_size // patch_size)**2 // scale_factor**2`` tokens."""

    def image_processor_settings(self, path, hf_config, label: str):
        """The bound is ``size["longest_edge"]`` (released: 4 tiles of ``max_image_size``);
        ``max_pixels = longest_edge**2``, ``min_pixels = 1``, no patch geometry (0s)."""
        from mm_token_pipeline.processor_config import ImageProcessorSettings

        tile = hf_config.vision_config.image_size
        longest, mean, std = 4 * tile, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        source = "released smolvlm defaults (no preprocessor_config.json)"
        if path is not None:
            from transformers import AutoImageProcessor

            proc = AutoImageProcessor.from_pretrained(path.parent)
            longest = int(proc.size["longest_edge"])
            mean, std = tuple(float(x) for x in proc.image_mean), tuple(float(x) for x in proc.image_std)
            source = str(path)
        return ImageProcessorSettings(min_pixels=1, max_pixels=longest * longest, patch_size=0, merge_size=0,
                                      temporal_patch_size=0, image_mean=mean, image_std=std, source=source,
                                      longest_edge=longest)

    def vision_params(self, hf_config) -> int:
        """SigLIP (``SmolVLMVisionTransformer``) + connector (``modality_projection``: one
        bias-free Linear after the pixel shuffle)."""
        v = hf_config.vision_config
        d, inter = v.hidden_size, v.intermediate_size
        embeddings = _linear(v.num_channels * v.patch_size**2, d) + (v.image_size // v.patch_size) ** 2 * d
        layer = 2 * 2 * d + 4 * _linear(d, d) + _linear(d, inter) + _linear(inter, d)
        connector = d * hf_config.scale_factor**2 * text_config(hf_config).hidden_size
        return embeddings + v.num_hidden_layers * layer + 2 * d + connector

    def vision_activation_shape(self, hf_config, max_pixels: int) -> tuple[int, int, int]:
        v = hf_config.vision_config
        tiles, per_tile, _ = _tiles(hf_config, max_pixels)
        return tiles * per_tile, v.hidden_size, v.intermediate_size

    def visual_tokens_per_image(self, hf_config, max_pixels: int) -> int:
        tiles, per_tile, _ = _tiles(hf_config, max_pixels)
        return tiles * per_tile // hf_config.scale_factor**2

    def largest_image_pixels(self, hf_config, max_tokens: int) -> int:
        """The largest ``(n * tile)**2`` square of ``n x n`` tiles (plus the global view) that fits."""
        tile = _tiles(hf_config, 1)[2]
        best, last = 0, 0
        for n in range(1, 64):  # stops at the processor's longest edge, where tokens stop growing
            pixels = (n * tile) ** 2
            tokens = self.visual_tokens_per_image(hf_config, pixels)
            if tokens > max_tokens or tokens == last:
                break
            best, last = pixels, tokens
        return best

    def video_tokens_per_clip(self, hf_config, seconds: float, video_sampling: dict | None, *, fps, max_frames,
                              nframes) -> tuple[int, int, int]:
        """HF ``SmolVLMVideoProcessor``: ``min(round(fps * seconds), max_frames)`` frames from
        the checkpoint's ``video_sampling``, each one ``max_image_size`` square of one tile's
        tokens; without a ``video_sampling`` the count is not stated (zeros)."""
        sampling = {**(video_sampling or {}), **({"fps": fps} if fps else {}),
                    **({"max_frames": max_frames} if max_frames else {})}
        if nframes:
            frames = int(nframes)
        elif "fps" not in sampling:
            return 0, 0, 0
        else:
            frames = int(round(sampling["fps"] * seconds))
            frames = max(1, min(frames, int(sampling["max_frames"])) if "max_frames" in sampling else frames)
        _, per_tile, tile = _tiles(hf_config, 1)
        return frames, tile * tile, frames * per_tile // hf_config.scale_factor**2
