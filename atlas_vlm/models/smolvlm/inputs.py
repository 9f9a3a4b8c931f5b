"""SmolVLM2 media inputs (``ModelFamily.mm_inputs``): prompt ids and tiles from the checkpoint's HF
processor, images bounded by a longest edge, videos by SmolVLM's own sampling; 1-D RoPE.
"""

from __future__ import annotations

from atlas_vlm.inputs.media import MediaInputs


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
        from atlas_vlm.models.smolvlm.prompt import longest_edge_for, smolvlm_prompt

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
        from atlas_vlm.models.smolvlm.video import load_smolvlm_video

        unsupported = sorted(k for k in opts if k not in ("fps", "max_frames", "nframes", "sample_fps"))
        if unsupported:
            raise ValueError(f"video {index}: option(s) {unsupported} do not apply to SmolVLM2, whose video "
                             "processor samples by fps / max_frames and resizes frames to its own video size")
        num_frames = opts.get("nframes", opts.get("max_frames"))
        return load_smolvlm_video(source, self.hf_processor.video_processor, fps=opts.get("fps"),
                                  num_frames=num_frames, source_fps=opts.get("sample_fps"), fetch=self._fetch)
