"""The image and video items of chat messages, in prompt order (every family's prompt reads them).

Scope: which content items are images or videos (the test the chat templates use), their
sources and per-item options. Each family renders its own prompt from them: Qwen2-VL /
Qwen2.5-VL / Qwen3-VL in ``atlas_vlm.models.qwen2_vl.prompt_ids`` (placeholder expansion and
the Qwen2.5-VL default template), SmolVLM in ``atlas_vlm.models.smolvlm.prompt``.
"""

from __future__ import annotations

__all__ = ["extract_images", "extract_image_items", "extract_mm_items", "is_image_item", "is_video_item",
           "item_source"]


def is_image_item(item: dict) -> bool:
    """Same test as the chat template: type image / image_url, or an 'image'/'image_url' key."""
    return item.get("type") in ("image", "image_url") or "image" in item or "image_url" in item


def is_video_item(item: dict) -> bool:
    """A video item: type video / video_url, or a 'video' / 'video_url' key (images win, as
    in the chat template, whose image test comes first)."""
    return not is_image_item(item) and (
        item.get("type") in ("video", "video_url") or "video" in item or "video_url" in item)


def item_source(item: dict, key: str, where: str):
    """The source of an image / video item: its ``key`` or ``{key}_url`` value (a
    ``{"url": ...}`` dict gives its url).

    Raises:
        ValueError: the item has none (``where`` names its message).
    """
    src = item.get(key, item.get(f"{key}_url"))
    if isinstance(src, dict):
        src = src.get("url")
    if src is None:
        raise ValueError(f"{where}: {key} item without a source: {item!r}")
    return src


def extract_mm_items(messages: list[dict]) -> list[tuple[str, object, dict]]:
    """``(modality, source, item)`` of every image and video item in prompt order.

    ``modality`` is ``"image"`` or ``"video"``; ``source`` is the item's ``image`` /
    ``image_url`` / ``video`` / ``video_url`` value (a ``{"url": ...}`` dict gives its url;
    a video may also be a list of frames); ``item`` carries per-item options.

    Raises:
        ValueError: an image or video item without a source.
    """
    found = []
    for m_idx, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for item in content:
            if is_image_item(item):
                found.append(("image", item_source(item, "image", f"messages[{m_idx}]"), item))
            elif is_video_item(item):
                found.append(("video", item_source(item, "video", f"messages[{m_idx}]"), item))
    return found


def extract_image_items(messages: list[dict]) -> list[tuple[object, dict]]:
    """``(source, item)`` of every image item of ``messages`` in prompt order (the order of
    ``<|image_pad|>``); ``item`` carries per-image options such as ``max_pixels``.

    ``{"type": "image", "image": src}`` gives ``src``; ``{"type": "image_url",
    "image_url": {"url": src}}`` (or a bare string) gives ``src``.

    Raises:
        ValueError: an image (or video) item without a source.
    """
    return [(src, item) for modality, src, item in extract_mm_items(messages) if modality == "image"]


def extract_images(messages: list[dict]) -> list:
    """Image sources of ``messages`` in prompt order (see :func:`extract_image_items`)."""
    return [src for src, _ in extract_image_items(messages)]
