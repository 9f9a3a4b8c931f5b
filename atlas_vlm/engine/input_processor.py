"""Turning what a caller passes (text, token ids, chat messages with images) into prompt
token ids, processed images, image spans and M-RoPE positions for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mm_kv_cache_management import ImageSpan


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]  # image pads expanded
    prompt: str | None = None  # text form, when known
    images: list = field(default_factory=list)  # mm_token_pipeline.ProcessedImage per image
    image_spans: list[ImageSpan] = field(default_factory=list)  # pad runs, in order
    mrope_positions: torch.Tensor | None = None  # [3, num_tokens], M-RoPE models only
    rope_delta: int = 0  # M-RoPE decode offset


def _image_spans(token_ids: list[int], images, image_token_id: int) -> list[ImageSpan]:
    spans, i = [], 0
    for img in images:
        while token_ids[i] != image_token_id:
            i += 1
        spans.append(ImageSpan(i, img.num_tokens, img.content_hash))
        i += img.num_tokens
    return spans


class InputProcessor:
    """Prompt preparation shared by ``LLMEngine.add_request`` and ``LLM.chat``.

    Args:
        tokenizer: the model's transformers tokenizer.
        hf_config: the model's transformers config (image token ids, merge size).
        config: ``EngineConfig`` (``min_pixels``, ``max_pixels``, ``allow_http_images``).
        vocab_size: the model's vocabulary size (embedding rows; may exceed the tokenizer's).
    """

    def __init__(self, tokenizer, hf_config, config, vocab_size: int):
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.config = config
        self.is_vlm = hasattr(hf_config, "vision_config")
        self.vocab_size = vocab_size  # rows of the model's embedding: the valid token ids
        self._hf_processor = None  # SmolVLM2: the checkpoint's HF processor, loaded on first use

    def from_text(self, prompt: str) -> ProcessedPrompt:
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return self._finish(ProcessedPrompt(list(ids), prompt=prompt))

    def from_token_ids(self, ids: list[int]) -> ProcessedPrompt:
        vocab = self.vocab_size
        if not ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be a non-empty list of ids in [0, {vocab})")
        return self._finish(ProcessedPrompt(list(ids)))

    def from_messages(self, messages: list[dict], mm_options: dict | None = None) -> ProcessedPrompt:
        """Chat messages (OpenAI / qwen-vl-utils style) through the tokenizer's chat template.

        Per-image ``min_pixels`` / ``max_pixels`` in a content item override ``mm_options``,
        which override the engine's defaults. SmolVLM2 reads ``longest_edge`` (its own
        bound) or maps ``max_pixels`` to one (``mm_token_pipeline.smolvlm.longest_edge_for``).

        Raises:
            mm_token_pipeline.ImageInputError: an image cannot be loaded or resized.
            ValueError: images sent to a text-only model.
        """
        from mm_token_pipeline import build_prompt_ids, extract_image_items, load_image, preprocess_image
        from mm_token_pipeline.qwen3_vl import QWEN3_VL_CHAT_TEMPLATE, image_kwargs  # models-vl (issue 9)

        items = extract_image_items(messages)
        if items and not self.is_vlm:
            raise ValueError("this model is text-only; it cannot take images")
        if not self.is_vlm:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return self._finish(ProcessedPrompt(list(ids)))
        if getattr(self.hf_config, "model_type", None) == "smolvlm":  # models-vl branch (issue 9)
            return self._finish(self._smolvlm_messages(messages, items, mm_options or {}))
        opts = {"min_pixels": self.config.min_pixels, "max_pixels": self.config.max_pixels, **(mm_options or {})}
        images = []
        for source, item in items:
            pil = load_image(source, allow_http=self.config.allow_http_images)
            images.append(preprocess_image(
                pil,
                min_pixels=item.get("min_pixels", opts["min_pixels"]),
                max_pixels=item.get("max_pixels", opts["max_pixels"]),
                **image_kwargs(self.hf_config),
            ))
        qwen3 = getattr(self.hf_config, "model_type", None) == "qwen3_vl"  # models-vl: its own fallback template
        ids = build_prompt_ids(self.tokenizer, messages, images,
                               default_template=QWEN3_VL_CHAT_TEMPLATE if qwen3 else None)
        return self._finish(ProcessedPrompt(list(ids), images=images))

    def _smolvlm_messages(self, messages, items, mm_options: dict) -> ProcessedPrompt:
        """SmolVLM2: ids and tiles from the checkpoint's HF processor (loaded once from the
        tokenizer's folder); the bound is a longest edge (``longest_edge``, or ``max_pixels``
        mapped to one, per image item, then ``mm_options``, then the engine's ``max_pixels``)."""
        from transformers import AutoProcessor

        from mm_token_pipeline import load_image
        from mm_token_pipeline.smolvlm import longest_edge_for, smolvlm_prompt

        if self._hf_processor is None:
            self._hf_processor = AutoProcessor.from_pretrained(self.tokenizer.name_or_path, fix_mistral_regex=False)
        proc = self._hf_processor
        tile, default = proc.image_processor.max_image_size["longest_edge"], proc.image_processor.size["longest_edge"]
        edges, pils = [], []
        for source, item in items:
            opts = {"max_pixels": self.config.max_pixels, **mm_options, **item}
            edges.append(longest_edge_for(opts.get("max_pixels"), opts.get("longest_edge"), tile=tile, default=default))
            pils.append(load_image(source, allow_http=self.config.allow_http_images))
        if len(set(edges)) > 1:
            raise ValueError(f"SmolVLM resizes all images of a prompt alike; got per-image longest edges {edges}")
        ids, tiles = smolvlm_prompt(proc, messages, pils, edges[0] if edges else default)
        return ProcessedPrompt(list(ids), images=tiles)

    def _finish(self, p: ProcessedPrompt) -> ProcessedPrompt:
        if not self.is_vlm:
            return p
        from mm_token_pipeline import get_rope_index

        cfg = self.hf_config
        image_token_id = cfg.image_token_id
        num_pads = sum(1 for t in p.prompt_token_ids if t == image_token_id)
        if num_pads != sum(img.num_tokens for img in p.images):
            raise ValueError(
                f"prompt holds {num_pads} <|image_pad|> tokens but its images need "
                f"{sum(img.num_tokens for img in p.images)}; pass images through chat messages"
            )
        p.image_spans = _image_spans(p.prompt_token_ids, p.images, image_token_id)
        if getattr(cfg, "model_type", None) == "smolvlm":  # 1-D RoPE: no M-RoPE positions (models-vl)
            return p
        p.mrope_positions, p.rope_delta = get_rope_index(
            p.prompt_token_ids,
            [img.grid_thw for img in p.images],
            spatial_merge_size=cfg.vision_config.spatial_merge_size,
            image_token_id=image_token_id,
            vision_start_token_id=cfg.vision_start_token_id,
        )
        return p

