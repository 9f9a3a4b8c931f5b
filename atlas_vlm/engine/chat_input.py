"""Chat prompts, as vLLM's ``LLM.chat`` takes them, to prompt token ids (and images).

The chat prompt dict (the one interface ``LLM.chat``, the server and ``LLM.generate`` share)::

    {"messages": [...],                    # OpenAI / qwen-vl-utils style messages
     "add_generation_prompt": True,         # open an assistant turn at the end
     "continue_final_message": False,       # end inside the last message (assistant prefill)
     "chat_template": None,                 # a Jinja template overriding the tokenizer's
     "chat_template_kwargs": None,          # extra variables for the template
     "mm_options": None,                    # MultiModalOptions | dict | None
     "tools": None}                         # OpenAI tools, rendered by the template

Rules (vLLM ``vllm/entrypoints/chat_utils.py`` and transformers ``apply_chat_template``):
text-only templates get the "string" content format (text parts joined with ``"\\n"``,
``None`` -> ``""``); the Qwen2.5-VL path keeps item lists. ``add_generation_prompt`` and
``continue_final_message`` both true is an error (transformers raises it; vLLM's server
refuses it too). Every key, role, content type and option is checked; none is ignored.
"""

from __future__ import annotations

from mm_token_pipeline import MultiModalOptions
from mm_token_pipeline.messages import check_messages, content_type, to_string_content

#: Keys of a chat prompt dict, with their defaults.
CHAT_PROMPT_DEFAULTS = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "mm_options": None,
    "tools": None,
}
#: ``apply_chat_template`` arguments that ``chat_template_kwargs`` may not set (each has its
#: own key in the prompt dict, or would change what ``apply_chat_template`` returns).
_RESERVED_TEMPLATE_KWARGS = {
    "add_generation_prompt", "continue_final_message", "chat_template", "conversation", "messages",
    "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask", "tools",
}


def parse_chat_prompt(prompt: dict) -> dict:
    """The chat prompt dict with defaults filled in and every value checked.

    Raises:
        ValueError: an unknown key (named), both ``add_generation_prompt`` and
            ``continue_final_message`` true, a reserved ``chat_template_kwargs`` key, or bad
            messages / ``mm_options`` (see ``check_messages``, ``MultiModalOptions``).
        TypeError: a value of the wrong type (named).
    """
    unknown = sorted(str(k) for k in prompt if k != "messages" and k not in CHAT_PROMPT_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in a chat prompt; allowed: "
                         f"{['messages', *CHAT_PROMPT_DEFAULTS]}")
    p = {**CHAT_PROMPT_DEFAULTS, **prompt}
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(p[name], bool):
            raise TypeError(f"{name} must be a bool, got {p[name]!r}")
    if p["add_generation_prompt"] and p["continue_final_message"]:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True: "
                         "continue_final_message continues the last message, add_generation_prompt "
                         "opens a new assistant turn (set add_generation_prompt=False)")
    if p["chat_template"] is not None and not isinstance(p["chat_template"], str):
        raise TypeError(f"chat_template must be a str (Jinja) or None, got {type(p['chat_template']).__name__}")
    kwargs = p["chat_template_kwargs"]
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise TypeError(f"chat_template_kwargs must be a dict with str keys or None, got {kwargs!r:.60}")
        reserved = sorted(k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}; use the chat prompt's own keys")
    tools = p["tools"]
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise TypeError(f"tools must be a list of dicts (OpenAI tool definitions) or None, got {tools!r:.60}")
    check_messages(p["messages"])
    if p["continue_final_message"] and not _has_text(p["messages"][-1]):
        raise ValueError("continue_final_message needs text in the last message to continue")
    p["mm_options"] = MultiModalOptions.from_value(p["mm_options"])
    return p


def _has_text(message: dict) -> bool:
    content = message.get("content")
    if isinstance(content, str):
        return True
    return any(content_type(item) == "text" for item in content or [])


class ChatInput:
    """Chat prompt -> ``ProcessedPrompt`` for one model.

    Args:
        tokenizer: the model's transformers tokenizer (its ``chat_template`` is the default).
        config: ``EngineConfig`` (``min_pixels``/``max_pixels`` over the checkpoint's,
            ``limit_request_pixels``, ``allow_http_images``, ``http_image_timeout_s``,
            ``http_image_max_bytes``).
        hf_config: the model's transformers config: a ``vision_config`` means images (the
            Qwen2-VL / Qwen2.5-VL / Qwen3-VL path, or SmolVLM2's HF processor).
        image_settings: the checkpoint's ``ImageProcessorSettings`` (its
            ``preprocessor_config.json``; ``LoadedModel.image_settings``), None for text models
            (read from ``hf_config`` alone, i.e. the released defaults, when not given).

    Raises:
        ValueError: the engine's pixel bounds contradict the checkpoint's (``EngineConfig.image_bounds``).
    """

    def __init__(self, tokenizer, config, hf_config, image_settings=None):
        from mm_token_pipeline import image_processor_settings

        self.tokenizer = tokenizer
        self.config = config
        self.hf_config = hf_config
        self.is_vlm = hasattr(hf_config, "vision_config")
        self.model_type = getattr(hf_config, "model_type", None)
        if image_settings is None and self.is_vlm:
            image_settings = image_processor_settings(None, hf_config)
        self.image_settings = image_settings
        self.engine_bounds = config.image_bounds(image_settings)  # checkpoint, then engine options
        self._hf_processor = None  # SmolVLM2: the checkpoint's HF processor, loaded on first use

    def process(self, prompt: dict) -> tuple[list[int], list]:
        """``(prompt token ids, processed images)`` of a chat prompt dict (see the module
        docstring); image pads are expanded, one ``ProcessedImage`` per image item in order.

        Per-image ``min_pixels`` / ``max_pixels`` in a content item override ``mm_options``,
        which override the engine's ``min_pixels`` / ``max_pixels``.

        Raises:
            ValueError, TypeError: see :func:`parse_chat_prompt`; images sent to a text-only model.
            mm_token_pipeline.ImageInputError: an image cannot be loaded, fetched or resized.
        """
        p = parse_chat_prompt(prompt)
        template_kwargs = {**(p["chat_template_kwargs"] or {}), **({"tools": p["tools"]} if p["tools"] else {})}
        template_args = dict(add_generation_prompt=p["add_generation_prompt"],
                             continue_final_message=p["continue_final_message"],
                             chat_template=p["chat_template"], **template_kwargs)
        if not self.is_vlm:
            ids = self.tokenizer.apply_chat_template(to_string_content(p["messages"]), tokenize=True,
                                                     return_dict=False, **template_args)
            return list(ids), []
        from mm_token_pipeline import build_prompt_ids, preprocess_image
        from mm_token_pipeline.qwen3_vl import QWEN3_VL_CHAT_TEMPLATE

        if self.model_type == "smolvlm":
            return self._smolvlm(p)
        images = []
        for opts, pil in self._images(p):
            if opts.longest_edge is not None:
                raise ValueError(f"longest_edge is SmolVLM's image bound; {self.model_type} takes "
                                 "min_pixels / max_pixels")
            min_pixels, max_pixels = opts.resolved()
            images.append(preprocess_image(pil, min_pixels=min_pixels, max_pixels=max_pixels,
                                           **self.image_settings.preprocess_kwargs()))
        ids = build_prompt_ids(self.tokenizer, p["messages"], images,
                               add_generation_prompt=p["add_generation_prompt"],
                               continue_final_message=p["continue_final_message"],
                               chat_template=p["chat_template"], chat_template_kwargs=template_kwargs,
                               default_template=QWEN3_VL_CHAT_TEMPLATE if self.model_type == "qwen3_vl" else None)
        return list(ids), images

    def _images(self, p: dict):
        """``(options, RGB PIL image)`` per image item: the item's bounds over the request's
        ``mm_options`` over the engine's (its ``min_pixels`` / ``max_pixels`` over the
        checkpoint's). With ``config.limit_request_pixels`` (the server) a request or item
        may lower ``max_pixels`` / ``longest_edge``, never raise them: checked before the
        image is loaded.

        Raises:
            ValueError: a bound above the engine's under ``limit_request_pixels`` (named).
        """
        from mm_token_pipeline import extract_image_items, load_image

        request_opts = p["mm_options"].merged_over(self.engine_bounds)
        for index, (source, item) in enumerate(extract_image_items(p["messages"])):
            item_opts = {k: item[k] for k in ("min_pixels", "max_pixels", "longest_edge") if k in item}
            opts = MultiModalOptions.from_value(item_opts, where=f"image {index}").merged_over(request_opts)
            if self.config.limit_request_pixels:
                self._check_limits(opts, index)
            pil = load_image(source, allow_http=self.config.allow_http_images,
                             http_timeout_s=self.config.http_image_timeout_s,
                             max_http_bytes=self.config.http_image_max_bytes)
            yield opts, pil

    def _check_limits(self, opts: MultiModalOptions, index: int) -> None:
        limits = {"max_pixels": self.engine_bounds.max_pixels,
                  "longest_edge": self.image_settings.longest_edge if self.image_settings else None}
        for name, limit in limits.items():
            value = getattr(opts, name)
            if value is not None and limit is not None and value > limit:
                raise ValueError(f"image {index}: {name} {value} is above this server's {name} {limit}; "
                                 "a request may lower the image bounds, not raise them")

    def _smolvlm(self, p: dict) -> tuple[list[int], list]:
        """SmolVLM2: ids and tiles from the checkpoint's HF processor (loaded once from the
        tokenizer's folder); the bound is a longest edge (``longest_edge``, or ``max_pixels``
        mapped to one: item, then ``mm_options``, then the engine's ``max_pixels``).

        Raises:
            ValueError: ``continue_final_message`` / a template override (not supported on
                this path), or per-image bounds that differ (the processor resizes alike)."""
        from transformers import AutoProcessor

        from mm_token_pipeline.smolvlm import longest_edge_for, smolvlm_prompt

        if p["continue_final_message"] or not p["add_generation_prompt"] or p["chat_template"] or p["chat_template_kwargs"] \
                or p["tools"]:
            raise ValueError("SmolVLM2 prompts take the processor's template with add_generation_prompt=True only; "
                             "continue_final_message, chat_template, chat_template_kwargs and tools are not supported")
        if self._hf_processor is None:
            self._hf_processor = AutoProcessor.from_pretrained(self.tokenizer.name_or_path, fix_mistral_regex=False)
        proc = self._hf_processor
        tile, default = proc.image_processor.max_image_size["longest_edge"], proc.image_processor.size["longest_edge"]
        edges, pils = [], []
        for opts, pil in self._images(p):
            edges.append(longest_edge_for(opts.max_pixels, opts.longest_edge, tile=tile, default=default))
            pils.append(pil)
        if len(set(edges)) > 1:
            raise ValueError(f"SmolVLM resizes all images of a prompt alike; got per-image longest edges {edges}")
        return smolvlm_prompt(proc, p["messages"], pils, edges[0] if edges else default)
