"""Per-family media inputs: a checked chat prompt -> prompt ids and media items, any modality.

Scope: what each model family does with the images and videos of a chat prompt, behind one
interface (``MediaInputs``) that ``ModelFamily.mm_inputs`` names, so no caller branches on
``model_type``. A family's inputs object

- loads every media item in prompt order (``load_image`` / ``load_video``; http(s) under the
  engine's policy), with the item's options over the request's ``mm_options`` over the
  engine's bounds over the checkpoint's;
- preprocesses it for its tower (``ProcessedImage`` / ``ProcessedVideo`` / SmolVLM tiles:
  each item has ``modality``, ``num_tokens`` encoder rows and a ``content_hash``);
- builds the prompt ids with every placeholder expanded (``prompt_ids``), and says which
  token id marks each modality's placeholders (``placeholder_token_ids``) and the M-RoPE
  positions of the prompt (``positions``).

Nothing here allocates KV blocks or touches the engine; it runs in the caller's thread or
an input worker (the server), never on the engine thread's step.
"""

from __future__ import annotations

import torch

from atlas_vlm.engine.tool_prompt import render_with_tools
from mm_token_pipeline import MultiModalOptions
from mm_token_pipeline.messages import VIDEO_OPTIONS as VIDEO_ITEM_OPTIONS


class MediaInputs:
    """Shared part of every family: option resolution and loading, in prompt order.

    Args:
        tokenizer: the model's (serialized) tokenizer.
        config: ``EngineConfig`` (http policy, ``limit_request_pixels``).
        hf_config: the model's transformers config.
        image_settings: the checkpoint's ``ImageProcessorSettings``.
        engine_bounds: ``config.image_bounds(image_settings)`` (a ``MultiModalOptions``).
        max_prompt_tokens: ``max_model_len - 1``: a video whose tokens alone reach it is
            refused from its stream's facts, before a frame is decoded; None: no check.
    """

    def __init__(self, tokenizer, config, hf_config, image_settings, engine_bounds: MultiModalOptions,
                 max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.hf_config = hf_config
        self.image_settings = image_settings
        self.engine_bounds = engine_bounds
        self.max_prompt_tokens = max_prompt_tokens  # media tokens past this are refused before decoding

    # ---- interface -------------------------------------------------------------------------
    def prompt_ids(self, p: dict) -> tuple[list[int], list]:
        """``(prompt ids with placeholders expanded, media items in prompt order)``."""
        raise NotImplementedError

    def placeholder_token_ids(self) -> dict[str, int]:
        """Token id of each modality's placeholder tokens, e.g. ``{"image": 151655, "video": 151656}``."""
        raise NotImplementedError

    def positions(self, ids: list[int], items: list) -> tuple[torch.Tensor | None, int]:
        """``(M-RoPE positions [3, N] or None for 1-D RoPE, rope_delta)`` of a prompt."""
        return None, 0

    # ---- shared ----------------------------------------------------------------------------
    def _fetch(self, url: str) -> bytes:
        """Download one http(s) medium under the engine's policy (``allow_http_images``)."""
        from mm_token_pipeline import fetch_url

        if not self.config.allow_http_images:
            raise ValueError(f"{url}: http(s) media are not fetched (allow_http_images is off)")
        return fetch_url(url, timeout_s=self.config.http_image_timeout_s, max_bytes=self.config.http_image_max_bytes)

    def _check_limits(self, opts: MultiModalOptions, where: str) -> None:
        limits = {"max_pixels": self.engine_bounds.max_pixels,
                  "longest_edge": self.image_settings.longest_edge if self.image_settings else None}
        for name, limit in limits.items():
            value = getattr(opts, name)
            if value is not None and limit is not None and value > limit:
                raise ValueError(f"{where}: {name} {value} is above this server's {name} {limit}; "
                                 "a request may lower the image bounds, not raise them")

    def media(self, p: dict):
        """``(modality, index within modality, options, medium)`` per media item, prompt order.

        Images: ``options`` is a ``MultiModalOptions`` (item over request over engine), the
        medium the loaded RGB PIL image. Videos: ``options`` is a dict of the item's
        ``VIDEO_ITEM_OPTIONS`` (its ``min_pixels`` / ``max_pixels`` falling back to the
        request's ``mm_options``), the medium the item's source, which each family loads
        with its own sampling rule (:meth:`load_video`). With ``config.limit_request_pixels``
        (the server) a request or item may lower ``max_pixels`` / ``longest_edge``, never
        raise them: checked before loading.

        Raises:
            ValueError: a bound above the engine's under ``limit_request_pixels`` (named);
                ``ImageInputError`` for an image that cannot be loaded.
        """
        from mm_token_pipeline import load_image
        from mm_token_pipeline.prompt import extract_mm_items

        request_opts = p["mm_options"].merged_over(self.engine_bounds)
        counts = {"image": 0, "video": 0}
        for modality, source, item in extract_mm_items(p["messages"]):
            index = counts[modality]
            counts[modality] += 1
            where = f"{modality} {index}"
            if modality == "image":
                item_opts = {k: item[k] for k in ("min_pixels", "max_pixels", "longest_edge") if k in item}
                opts = MultiModalOptions.from_value(item_opts, where=where).merged_over(request_opts)
                if self.config.limit_request_pixels:
                    self._check_limits(opts, where)
                yield modality, index, opts, load_image(
                    source, allow_http=self.config.allow_http_images, http_timeout_s=self.config.http_image_timeout_s,
                    max_http_bytes=self.config.http_image_max_bytes)
                continue
            asked = p["mm_options"]
            opts = {k: v for k, v in (("min_pixels", asked.min_pixels), ("max_pixels", asked.max_pixels)) if v}
            opts.update({k: item[k] for k in VIDEO_ITEM_OPTIONS if item.get(k) is not None})
            if self.config.limit_request_pixels:
                self._check_limits(MultiModalOptions(max_pixels=opts.get("max_pixels")), where)
            yield modality, index, opts, source


class QwenVLInputs(MediaInputs):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: qwen-vl-utils resizing, HF patchify, M-RoPE.

    Images: ``smart_resize`` under ``min_pixels`` / ``max_pixels``; videos: qwen-vl-utils'
    frame sampling and per-frame bounds under ``total_pixels`` (``preprocess_video``).
    Positions: HF ``get_rope_index`` of the family (Qwen2.5-VL scales the temporal axis by
    ``second_per_grid_t * tokens_per_second``; Qwen3-VL writes timestamps in the prompt).
    """

    #: model types whose video prompts carry ``<t seconds>`` per temporal group and whose
    #: positions split each video grid per group: Qwen3-VL and Qwen3.5 (``AutoProcessor``
    #: gives both ``Qwen3VLProcessor``; HF ``Qwen3_5Model.get_rope_index`` splits as Qwen3-VL's).
    TIMESTAMPED_VIDEOS = ("qwen3_vl", "qwen3_5")

    def prompt_ids(self, p: dict) -> tuple[list[int], list]:
        from mm_token_pipeline import build_prompt_ids, preprocess_image
        from mm_token_pipeline.qwen3_vl import QWEN3_VL_CHAT_TEMPLATE

        family = self.hf_config.model_type
        stamped = family in self.TIMESTAMPED_VIDEOS
        geometry = self.image_settings.preprocess_kwargs()
        items = []
        for modality, index, opts, medium in self.media(p):
            if modality == "image":
                if opts.longest_edge is not None:
                    raise ValueError(f"longest_edge is SmolVLM's image bound; {family} takes min_pixels / max_pixels")
                min_pixels, max_pixels = opts.resolved()
                items.append(preprocess_image(medium, min_pixels=min_pixels, max_pixels=max_pixels, **geometry))
            else:
                from mm_token_pipeline import VideoInputError, load_video, preprocess_video

                sampling = {k: opts[k] for k in ("fps", "nframes", "min_frames", "max_frames", "video_start",
                                                 "video_end", "sample_fps") if k in opts}
                bounds = {k: opts[k] for k in ("min_pixels", "max_pixels", "total_pixels") if k in opts}
                check = self._video_token_check(bounds, index, sum(it.num_tokens for it in items))
                frames = load_video(medium, fetch=self._fetch, before_decode=check, **sampling)  # seeking
                if frames.sample_fps is None and family != "qwen2_vl":
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
                                         default_template=QWEN3_VL_CHAT_TEMPLATE if stamped else None,
                                         video_timestamps=stamped))  # Qwen3-VL, Qwen3.5: '<t seconds>' per group

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
        from atlas_vlm.engine.input_processor import RequestTooLongError
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
        if cfg.model_type in self.TIMESTAMPED_VIDEOS:
            from mm_token_pipeline.qwen3_vl import get_rope_index_qwen3_vl

            return get_rope_index_qwen3_vl(ids, images, [v.grid_thw for v in videos],
                                           video_token_id=cfg.video_token_id, **common)
        tokens_per_second = getattr(cfg.vision_config, "tokens_per_second", None) \
            if cfg.model_type == "qwen2_5_vl" else None
        return get_rope_index(ids, images, video_grid_thw=[v.grid_thw for v in videos],
                              second_per_grid_ts=[v.second_per_grid_t for v in videos],
                              tokens_per_second=tokens_per_second, video_token_id=cfg.video_token_id, **common)


class SmolVLMInputs(MediaInputs):
    """SmolVLM2: prompt ids and tiles from the checkpoint's HF processor (loaded once from the
    tokenizer's folder); images bounded by a longest edge (``longest_edge``, or
    ``max_pixels`` mapped to one: item, then ``mm_options``, then the engine's
    ``max_pixels``); 1-D RoPE (no M-RoPE positions)."""

    _processor = None

    @property
    def hf_processor(self):
        """The checkpoint's HF ``SmolVLMProcessor`` (loaded once, from the tokenizer's folder)."""
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.tokenizer.name_or_path, fix_mistral_regex=False)
        return self._processor

    def placeholder_token_ids(self) -> dict[str, int]:
        token = self.hf_config.image_token_id  # video frames are images to SmolVLM
        return {"image": token, "video": token}

    def prompt_ids(self, p: dict) -> tuple[list[int], list]:
        """Raises:
            ValueError: ``continue_final_message`` / a template override (not supported on
                this path), or per-image bounds that differ (the processor resizes alike)."""
        from mm_token_pipeline.smolvlm import longest_edge_for, smolvlm_prompt

        if p["continue_final_message"] or not p["add_generation_prompt"] or p["chat_template"] \
                or p["chat_template_kwargs"] or p["tools"]:
            raise ValueError("SmolVLM2 prompts take the processor's template with add_generation_prompt=True only; "
                             "continue_final_message, chat_template, chat_template_kwargs and tools are not supported")
        proc = self.hf_processor
        tile, default = proc.image_processor.max_image_size["longest_edge"], proc.image_processor.size["longest_edge"]
        edges, pils, videos = [], [], []
        for modality, index, opts, medium in self.media(p):
            if modality == "video":
                videos.append(self._load_video(medium, opts, index))
                continue
            edges.append(longest_edge_for(opts.max_pixels, opts.longest_edge, tile=tile, default=default))
            pils.append(medium)
        if len(set(edges)) > 1:
            raise ValueError(f"SmolVLM resizes all images of a prompt alike; got per-image longest edges {edges}")
        return smolvlm_prompt(proc, p["messages"], pils, edges[0] if edges else default, videos=videos or None)

    def _load_video(self, source, opts: dict, index: int):
        """One video sampled by SmolVLM's own rule (HF ``SmolVLMVideoProcessor.sample_frames``:
        the item's ``fps`` and ``max_frames`` / ``nframes`` over the checkpoint's
        ``video_sampling``); frames resize to the checkpoint's video size (pixel bounds do
        not apply: refused by name).

        Raises:
            ValueError: an option SmolVLM's sampling has no counterpart for (named).
        """
        from mm_token_pipeline.smolvlm_video import load_smolvlm_video

        unsupported = sorted(k for k in opts if k not in ("fps", "max_frames", "nframes", "sample_fps"))
        if unsupported:
            raise ValueError(f"video {index}: option(s) {unsupported} do not apply to SmolVLM2, whose video "
                             "processor samples by fps / max_frames and resizes frames to its own video size")
        num_frames = opts.get("nframes", opts.get("max_frames"))
        return load_smolvlm_video(source, self.hf_processor.video_processor, fps=opts.get("fps"),
                                  num_frames=num_frames, source_fps=opts.get("sample_fps"), fetch=self._fetch)
