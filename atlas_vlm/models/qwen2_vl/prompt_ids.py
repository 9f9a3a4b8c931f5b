"""Qwen-VL chat prompts to token ids with expanded image and video placeholders.

Scope: render OpenAI / qwen-vl-utils style messages with the model's chat template (else the
Qwen2.5-VL one, ``QWEN2_5_VL_CHAT_TEMPLATE``, also the default VLM's) through HF
``tokenizer.apply_chat_template``, tokenize so that user text never becomes special token ids
(case C08), and expand each ``<|image_pad|>`` / ``<|video_pad|>`` to the item's tokens taken
from its ``grid_thw``: ``num_tokens`` pads (HF ``Qwen2_5_VLProcessor`` /
``Qwen2VLProcessor.replace_*_token``), or for Qwen3-VL videos one
``<{t:.1f} seconds><|vision_start|>pads<|vision_end|>`` per temporal group (HF
``Qwen3VLProcessor.replace_video_token``). Used by Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5.
"""

from __future__ import annotations

import re
import uuid

from mm_token_pipeline.processor import ProcessedImage
from mm_token_pipeline.prompt import is_image_item, is_video_item, item_source
from mm_token_pipeline.video_processor import ProcessedVideo

__all__ = ["QWEN2_5_VL_CHAT_TEMPLATE", "build_prompt_ids", "expand_image_pads"]

#: Official Qwen2.5-VL-Instruct chat template (identical to Qwen2-VL's, as in HF
#: transformers' Qwen2-VL processor tests): default system prompt, one
#: ``<|vision_start|><|image_pad|><|vision_end|>`` per image item.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def expand_image_pads(token_ids: list[int], num_tokens_per_image: list[int], *, image_token_id: int) -> list[int]:
    """Replace the i-th single ``image_token_id`` by ``num_tokens_per_image[i]`` copies.

    Token counts come from ``ProcessedImage.num_tokens`` (``t*h*w // merge**2`` of grid_thw).
    Output length: ``len(token_ids) - n_images + sum(num_tokens_per_image)`` tokens.

    Raises:
        ValueError: the number of image tokens differs from ``len(num_tokens_per_image)``,
            or a count is below 1.
    """
    n_pads = sum(1 for t in token_ids if t == image_token_id)
    if n_pads != len(num_tokens_per_image):
        raise ValueError(f"prompt has {n_pads} image placeholders but {len(num_tokens_per_image)} images were given")
    if any(int(c) < 1 for c in num_tokens_per_image):
        raise ValueError(f"every image needs >= 1 token, got {list(num_tokens_per_image)}")
    out: list[int] = []
    counts = iter(num_tokens_per_image)
    for t in token_ids:
        out.extend([t] * int(next(counts)) if t == image_token_id else [t])
    return out


def _expand(ids: list[int], processed: list, tokenizer, *, video_timestamps: bool) -> list[int]:
    """Expand each pad token to its item's run (items in prompt order, checked by modality)."""
    image_id, video_id = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    start_id, end_id = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    pads = [("image" if t == image_id else "video") for t in ids if t in (image_id, video_id)]
    given = [getattr(p, "modality", "image") for p in processed]
    for modality in ("image", "video"):
        if pads.count(modality) != given.count(modality):
            raise ValueError(f"prompt has {pads.count(modality)} {modality} placeholders but "
                             f"{given.count(modality)} {modality}s were given")
    if pads != given:
        raise ValueError(f"processed items must follow the prompt's media order {pads}, got {given}")
    out: list[int] = []
    items = iter(processed)
    skip_end = False
    for i, t in enumerate(ids):
        if skip_end:  # the wrapper's <|vision_end|>, replaced with its video
            skip_end = False
            continue
        if t != image_id and t != video_id:
            out.append(t)
            continue
        item = next(items)
        if int(item.num_tokens) < 1:
            raise ValueError(f"every {item.modality} needs >= 1 token, got {item.num_tokens}")
        if t == video_id and video_timestamps:
            grid_t = int(item.grid_thw[0])
            if len(item.timestamps) != grid_t:
                raise ValueError(f"video {item.source}: {len(item.timestamps)} timestamps for grid_t {grid_t}")
            if out and out[-1] == start_id and i + 1 < len(ids) and ids[i + 1] == end_id:
                out.pop()  # the whole <|vision_start|><|video_pad|><|vision_end|> is replaced
                skip_end = True
            for seconds in item.timestamps:  # HF Qwen3VLProcessor.replace_video_token, per temporal group
                out.extend(tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"])
                out.extend([start_id] + [video_id] * (int(item.num_tokens) // grid_t) + [end_id])
        else:
            out.extend([t] * int(item.num_tokens))
    return out


def build_prompt_ids(tokenizer, messages: list[dict], processed: list[ProcessedImage | ProcessedVideo], *,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                     default_template: str | None = None, video_timestamps: bool = False) -> list[int]:
    """Token ids of a chat prompt with each image / video expanded to its pad tokens.

    The template (``chat_template`` if given, else ``tokenizer.chat_template`` if it renders
    images, else ``default_template`` or :data:`QWEN2_5_VL_CHAT_TEMPLATE`) is rendered by HF ``apply_chat_template``
    (with ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``) with every user text replaced by a unique
    sentinel; template pieces are tokenized with special tokens recognised, user texts with
    ``split_special_tokens=True``, so literal ``'<|image_pad|>'`` in user text stays plain
    text (case C08). Pieces are tokenized separately: BPE never merges across a text boundary.
    ``video_url`` items are rendered as ``video`` items (the templates test the ``video`` key).

    Expansion: an image or a Qwen2/2.5-VL video becomes ``num_tokens`` pads inside the
    template's ``<|vision_start|>`` / ``<|vision_end|>``; with ``video_timestamps`` (Qwen3-VL) a
    video becomes, per temporal group ``i``, the text ``f"<{timestamps[i]:.1f} seconds>"`` then
    ``<|vision_start|>``, ``num_tokens // grid_t`` pads, ``<|vision_end|>``, replacing the
    template's whole ``<|vision_start|><|video_pad|><|vision_end|>`` (or a bare pad token), as
    Qwen's own processor and transformers >= 5.25's ``Qwen3VLProcessor`` do (5.24 kept the
    template's wrapper around the groups).

    Args:
        tokenizer: a HF Qwen2 tokenizer (e.g. ``AutoTokenizer.from_pretrained(qwen_tokenizer_dir())``).
        messages: ``[{"role": ..., "content": str | [items]}]``, items of type image / image_url /
            video / video_url / text.
        processed: one :class:`ProcessedImage` or :class:`ProcessedVideo` per media item, in
            :func:`extract_mm_items` order (images and videos mixed as in the messages).
        continue_final_message: end the prompt right after the last message's text (no
            end-of-turn), as transformers' ``apply_chat_template(continue_final_message=True)``:
            its last text item is the one continued.
        video_timestamps: Qwen3-VL's per-group timestamp layout (False: Qwen2-VL / Qwen2.5-VL).

    Raises:
        ValueError: image or video count mismatch, items not in the prompt's media order, or
            ``add_generation_prompt`` and ``continue_final_message`` both true (transformers).
    """
    sentinel = f"@@mmtp{uuid.uuid4().hex}@@"
    texts: list[str] = []

    def sub(text: str) -> str:
        texts.append(text)
        return f"{sentinel}{len(texts) - 1}{sentinel}"

    masked = []
    for m_idx, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            masked.append({**message, "content": sub(content)})
            continue
        items = []
        for item in content or []:
            if is_video_item(item):
                item = {**item, "type": "video", "video": item_source(item, "video", f"messages[{m_idx}]")}
            elif not is_image_item(item) and "text" in item:
                item = {**item, "text": sub(item["text"])}
            items.append(item)
        masked.append({**message, "content": items})
    template = chat_template or tokenizer.chat_template
    if chat_template is None and (not template or ("image_pad" not in template and "vision_start" not in template)):
        template = default_template or QWEN2_5_VL_CHAT_TEMPLATE
    # the sentinel of the last text stands for it when transformers cuts after the final message
    rendered = tokenizer.apply_chat_template(masked, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(chat_template_kwargs or {}))
    ids: list[int] = []
    # split with a capture group: even pieces are template text, odd pieces are text indices
    pieces = re.split(re.escape(sentinel) + r"(\d+)" + re.escape(sentinel), rendered)
    for k, piece in enumerate(pieces):
        text, user = (texts[int(piece)], True) if k % 2 else (piece, False)
        if text:
            ids.extend(tokenizer(text, add_special_tokens=False, split_special_tokens=user)["input_ids"])
    return _expand(ids, list(processed), tokenizer, video_timestamps=video_timestamps)
