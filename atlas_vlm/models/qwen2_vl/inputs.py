"""Qwen2-VL / Qwen2.5-VL media inputs (``ModelFamily.mm_inputs``): qwen-vl-utils resizing, HF
patchify, M-RoPE positions; Qwen3-VL's subclass is ``atlas_vlm.models.qwen3_vl.inputs``.
"""

from __future__ import annotations

import torch

from atlas_vlm.inputs.media import MediaInputs
from atlas_vlm.inputs.tool_prompt import render_with_tools


class QwenVLInputs(MediaInputs):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: qwen-vl-utils resizing, HF patchify, M-RoPE.

    Images: ``smart_resize`` under ``min_pixels`` / ``max_pixels``; videos: qwen-vl-utils'
    frame sampling and per-frame bounds under ``total_pixels`` (``preprocess_video``).
    Positions: HF ``get_rope_index`` of the family (Qwen2.5-VL scales the temporal axis by
    ``second_per_grid_t * tokens_per_second``; Qwen3-VL writes timestamps in the prompt).
    The family subclasses (``Qwen2VLInputs``, ``Qwen2_5_VLInputs``,
    ``qwen3_vl.inputs.Qwen3VLInputs``) set what differs:

    Attributes:
        video_needs_fps: a video's source fps is required (seconds per temporal group feed
            M-RoPE or timestamps); Qwen2-VL's positions do not use it.
        default_chat_template: the template when the tokenizer has none that renders images (None:
            Qwen2.5-VL's, ``prompt_ids.QWEN2_5_VL_CHAT_TEMPLATE``).
        video_timestamps: ``'<t seconds>'`` per temporal group in the prompt (Qwen3-VL).
    """

    video_needs_fps: bool = True
    default_chat_template: str | None = None
    video_timestamps: bool = False

    def prompt_ids(self, p: dict) -> tuple[list[int], list]:
        from .image_processor import preprocess_image
        from .prompt_ids import build_prompt_ids

        family = self.hf_config.model_type
        geometry = self.image_settings.preprocess_kwargs()
        items = []
        for modality, index, opts, medium in self.media(p):
            if modality == "image":
                if opts.longest_edge is not None:
                    raise ValueError(f"longest_edge is SmolVLM's image bound; {family} takes min_pixels / max_pixels")
                min_pixels, max_pixels = opts.resolved()
                items.append(preprocess_image(medium, min_pixels=min_pixels, max_pixels=max_pixels, **geometry))
            else:
                from mm_token_pipeline import VideoInputError, load_video

                from .video_processor import preprocess_video

                sampling = {k: opts[k] for k in ("fps", "nframes", "min_frames", "max_frames", "video_start",
                                                 "video_end", "sample_fps") if k in opts}
                bounds = {k: opts[k] for k in ("min_pixels", "max_pixels", "total_pixels") if k in opts}
                check = self._video_token_check(bounds, index, sum(it.num_tokens for it in items))
                frames = load_video(medium, fetch=self._fetch, before_decode=check, **sampling)  # seeking
                if frames.sample_fps is None and self.video_needs_fps:
                    raise VideoInputError(frames.source, f"the source fps is unknown, and {family} needs it "
                                          "(seconds per temporal group: M-RoPE / timestamps); give a file that "
                                          "states its frame rate, or a list of frames with sample_fps")
                items.append(preprocess_video(frames, source=frames.source, **bounds, **geometry))

        def render(q: dict) -> list[int]:
            template_kwargs = {**(q["chat_template_kwargs"] or {}), **({"tools": q["tools"]} if q["tools"] else {})}
            return list(build_prompt_ids(self.tokenizer, q["messages"], items,
                                         add_generation_prompt=q["add_generation_prompt"],
                                         continue_final_message=q["continue_final_message"],
                                         chat_template=q["chat_template"], chat_template_kwargs=template_kwargs,
                                         default_template=self.default_chat_template,
                                         video_timestamps=self.video_timestamps))

        return render_with_tools(render, p), items  # a template without tools: the system-prompt fallback

    def _video_token_check(self, bounds: dict, index: int, before: int):
        """``load_video``'s ``before_decode`` hook: refuse a video whose tokens (with the
        ``before`` tokens of earlier items) reach ``max_prompt_tokens``, from the stream's
        facts and the sampled frame count alone, so an oversized request costs no decoding
        memory. None when there is no bound.

        Raises (from the hook):
            RequestTooLongError: the video's frames and tokens named.
        """
        if self.max_prompt_tokens is None:
            return None
        from atlas_vlm.inputs.media import RequestTooLongError
        from mm_token_pipeline import video_resized_size

        geometry = self.image_settings

        def check(probe, sampling) -> None:
            nframes = sampling.nframes
            h, w = video_resized_size(probe.height, probe.width, nframes, patch_size=geometry.patch_size,
                                      merge_size=geometry.merge_size, source=probe.source, **bounds)
            factor = geometry.patch_size * geometry.merge_size
            tokens = nframes // geometry.temporal_patch_size * (h // factor) * (w // factor)
            if before + tokens >= self.max_prompt_tokens:
                raise RequestTooLongError(
                    f"video {index} ({probe.source}): {nframes} frames of {w}x{h} pixels are {tokens} visual "
                    f"tokens{f' after {before} of earlier media' if before else ''}; max_model_len is "
                    f"{self.max_prompt_tokens + 1}: lower fps / max_frames / max_pixels / total_pixels or raise "
                    "max_model_len")
        return check

    def placeholder_token_ids(self) -> dict[str, int]:
        cfg = self.hf_config
        return {"image": cfg.image_token_id, "video": cfg.video_token_id}

    def positions(self, ids: list[int], items: list) -> tuple[torch.Tensor, int]:
        from mm_token_pipeline import get_rope_index

        cfg = self.hf_config
        images = [it.grid_thw for it in items if it.modality == "image"]
        videos = [it for it in items if it.modality == "video"]
        common = dict(spatial_merge_size=cfg.vision_config.spatial_merge_size, image_token_id=cfg.image_token_id,
                      vision_start_token_id=cfg.vision_start_token_id)
        if not videos:
            return get_rope_index(ids, images, **common)
        return self.video_positions(ids, images, videos, common)

    def video_positions(self, ids: list[int], images: list, videos: list, common: dict) -> tuple[torch.Tensor, int]:
        """Positions of a prompt with videos: HF ``get_rope_index`` (temporal axis per frame
        group, scaled by ``second_per_grid_t * tokens_per_second``, which only Qwen2.5-VL
        states: :meth:`tokens_per_second`)."""
        from mm_token_pipeline import get_rope_index

        cfg = self.hf_config
        tokens_per_second = self.tokens_per_second()
        return get_rope_index(ids, images, video_grid_thw=[v.grid_thw for v in videos],
                              second_per_grid_ts=[v.second_per_grid_t for v in videos],
                              tokens_per_second=tokens_per_second, video_token_id=cfg.video_token_id, **common)

    def tokens_per_second(self) -> float | None:
        """Temporal M-RoPE units per second of video (None: positions count frame groups)."""
        return None


class Qwen2VLInputs(QwenVLInputs):
    """Qwen2-VL: positions count frame groups, so a video's fps is not needed."""

    video_needs_fps = False


class Qwen2_5_VLInputs(QwenVLInputs):
    """Qwen2.5-VL: the temporal axis advances ``second_per_grid_t * tokens_per_second``."""

    def tokens_per_second(self) -> float | None:
        return getattr(self.hf_config.vision_config, "tokens_per_second", None)
