"""Chat prompts, as vLLM's ``LLM.chat`` takes them, to prompt token ids (and images).

The chat prompt dict (the one interface ``LLM.chat``, the server and ``LLM.generate`` share)::

    {"messages": [...],                    # OpenAI / qwen-vl-utils style messages
     "add_generation_prompt": True,         # open an assistant turn at the end
     "continue_final_message": False,       # end inside the last message (assistant prefill)
     "chat_template": None,                 # a Jinja template overriding the tokenizer's
     "chat_template_kwargs": None,          # extra variables for the template
     "mm_options": None,                    # MultiModalOptions | dict | None
     "tools": None}                         # OpenAI tools, rendered by the template (else
                                            # by inputs/tool_prompt.py's system prompt)

Rules (vLLM ``vllm/entrypoints/chat_utils.py`` and transformers ``apply_chat_template``):
text-only templates get the "string" content format (text parts joined with ``"\\n"``,
``None`` -> ``""``); the Qwen2.5-VL path keeps item lists. ``add_generation_prompt`` and
``continue_final_message`` both true is an error (transformers raises it; vLLM's server
refuses it too). Every key, role, content type and option is checked; none is ignored.
"""

from __future__ import annotations

from atlas_vlm.inputs.tool_prompt import render_with_tools
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
    """Chat prompt -> prompt ids and media items for one model.

    Args:
        tokenizer: the model's transformers tokenizer (its ``chat_template`` is the default).
        config: ``EngineConfig`` (its ``multimodal_config``: ``min_pixels``/``max_pixels`` over
            the checkpoint's, ``limit_request_pixels``, the media fetch policy).
        hf_config: the model's transformers config; its ``ModelFamily.mm_inputs`` handles
            the media (``inputs.media.MediaInputs``, one subclass per family folder), text models take none.
        image_settings: the checkpoint's ``ImageProcessorSettings`` (its
            ``preprocessor_config.json``; ``LoadedModel.image_settings``), None for text models
            (read from ``hf_config`` alone, i.e. the released defaults, when not given).
        max_model_len: tokens per request; a video over it is refused before decoding.

    Raises:
        ValueError: the engine's pixel bounds contradict the checkpoint's (``MultiModalConfig.image_bounds``).
    """

    def __init__(self, tokenizer, config, hf_config, image_settings=None, max_model_len: int | None = None):
        from atlas_vlm.models.registry import import_named, resolve_family
        from atlas_vlm.models.processor_settings import image_processor_settings

        self.tokenizer = tokenizer
        self.config = config
        self.hf_config = hf_config
        self.family = resolve_family(hf_config)
        if image_settings is None and self.family.multimodal:
            image_settings = image_processor_settings(None, hf_config)
        self.image_settings = image_settings
        self.engine_bounds = config.multimodal_config.image_bounds(image_settings)  # checkpoint, then engine options
        self.media = None  # the family's MediaInputs; None for text models
        if self.family.mm_inputs is not None:
            self.media = import_named(self.family.mm_inputs)(
                tokenizer, config, hf_config, image_settings, self.engine_bounds,
                max_prompt_tokens=max_model_len - 1 if max_model_len else None)

    def process(self, prompt: dict) -> tuple[list[int], list]:
        """``(prompt token ids, media items)`` of a chat prompt dict (see the module
        docstring); placeholders are expanded, one item per image / video (SmolVLM: per
        tile) in prompt order.

        Per-item ``min_pixels`` / ``max_pixels`` in a content item override ``mm_options``,
        which override the engine's ``min_pixels`` / ``max_pixels``.

        Raises:
            ValueError, TypeError: see :func:`parse_chat_prompt`; media sent to a text-only
                model, or a modality this family does not take (named).
            mm_token_pipeline.ImageInputError / VideoInputError: a medium cannot be loaded,
                fetched or resized.
        """
        p = parse_chat_prompt(prompt)
        if self.media is None:
            return render_with_tools(self._render_text, p), []
        for i, message in enumerate(p["messages"]):
            for item in message.get("content") if isinstance(message.get("content"), list) else ():
                kind = content_type(item).removesuffix("_url")
                if kind != "text" and kind not in self.family.modalities:
                    raise ValueError(f"messages[{i}]: {self.family.name} does not take {kind} input "
                                     f"(it takes {', '.join(self.family.modalities)})")
        return self.media.prompt_ids(p)

    def _render_text(self, p: dict) -> list[int]:
        """A text model's prompt ids: the template over string contents."""
        template_kwargs = {**(p["chat_template_kwargs"] or {}), **({"tools": p["tools"]} if p["tools"] else {})}
        return list(self.tokenizer.apply_chat_template(
            to_string_content(p["messages"]), tokenize=True, return_dict=False,
            add_generation_prompt=p["add_generation_prompt"], continue_final_message=p["continue_final_message"],
            chat_template=p["chat_template"], **template_kwargs))
