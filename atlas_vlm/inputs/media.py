"""Per-family media inputs: a checked chat prompt -> prompt ids and media items, any modality.

Scope: what each model family does with the images and videos of a chat prompt, behind one
interface (``MediaInputs``, here) that ``ModelFamily.mm_inputs`` names, so no caller branches on
the model type; each family's subclass lives in its folder (``atlas_vlm.models.qwen2_vl.inputs``,
``qwen3_vl.inputs``, ``smolvlm.inputs``). A family's inputs object

- loads every media item in prompt order (``load_image`` / ``load_video``; http(s) under the
  engine's policy), with the item's options over the request's ``mm_options`` over the
  engine's bounds over the checkpoint's;
- preprocesses it for its tower (``ProcessedImage`` / ``ProcessedVideo`` / SmolVLM tiles:
  each item has ``modality``, ``num_tokens`` encoder rows and a ``content_hash``);
- builds the prompt ids with every placeholder expanded (``prompt_ids``), and says which
  token id marks each modality's placeholders (``placeholder_token_ids``) and the M-RoPE
  positions of the prompt (``positions``).

``RequestTooLongError`` lives here too, so a family's inputs can raise it without importing the
engine. Nothing here allocates KV blocks or touches the engine; it runs in the caller's thread or
an input worker (the server), never on the engine thread's step.
"""

from __future__ import annotations

import torch

from mm_token_pipeline import MultiModalOptions
from mm_token_pipeline.messages import VIDEO_OPTIONS as VIDEO_ITEM_OPTIONS


class RequestTooLongError(ValueError):
    """A request can never fit: over ``max_model_len`` or over the whole KV capacity (raised by
    the engine's ``InputProcessor``, and by a family's inputs when one video alone is too long)."""


class MediaInputs:
    """Shared part of every family: option resolution and loading, in prompt order.

    Args:
        tokenizer: the model's (serialized) tokenizer.
        config: ``EngineConfig`` (its ``multimodal_config``: the fetch policy, ``limit_request_pixels``).
        hf_config: the model's transformers config.
        image_settings: the checkpoint's ``ImageProcessorSettings``.
        engine_bounds: ``config.multimodal_config.image_bounds(image_settings)`` (a ``MultiModalOptions``).
        max_prompt_tokens: ``max_model_len - 1``: a video whose tokens alone reach it is
            refused from its stream's facts, before a frame is decoded; None: no check.
    """

    def __init__(self, tokenizer, config, hf_config, image_settings, engine_bounds: MultiModalOptions,
                 max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.mm_config = config.multimodal_config
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
        """Download one http(s) video under the engine's ``MediaFetchPolicy``
        (``multimodal_config.media``: the server's rules, its ``max_video_bytes`` cap).

        Raises:
            ValueError: http(s) media are off; ``MediaRefused`` (a ValueError) for a refused host.
            DownloadError: the download failed, was late or went over the cap.
        """
        from mm_token_pipeline import fetch_url

        policy = self.mm_config.media
        if not policy.allow_http_images:
            raise ValueError(f"{url}: http(s) media are not fetched (allow_http_images is off)")
        return fetch_url(url, timeout_s=policy.http_timeout_s, max_bytes=policy.max_bytes("video"), policy=policy)

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
        with its own sampling rule (:meth:`load_video`). With ``multimodal_config.limit_request_pixels``
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
                if self.mm_config.limit_request_pixels:
                    self._check_limits(opts, where)
                yield modality, index, opts, load_image(source, fetch_policy=self.mm_config.media)
                continue
            asked = p["mm_options"]
            opts = {k: v for k, v in (("min_pixels", asked.min_pixels), ("max_pixels", asked.max_pixels)) if v}
            opts.update({k: item[k] for k in VIDEO_ITEM_OPTIONS if item.get(k) is not None})
            if self.mm_config.limit_request_pixels:
                self._check_limits(MultiModalOptions(max_pixels=opts.get("max_pixels")), where)
            yield modality, index, opts, source
