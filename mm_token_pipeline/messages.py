"""Chat messages: validation and the two content formats of vLLM's chat input.

Scope: ``check_messages`` refuses what would otherwise be ignored without a word (an
unknown role, message key, content type or item key; a text item without text), naming
it; ``to_string_content`` gives the "string" content format for text-only templates.

Content formats follow vLLM (``vllm/entrypoints/chat_utils.py``,
``_parse_chat_message_content``): ``None`` content becomes no parts, a string one text part;
in the "string" format (templates that concatenate ``message['content']``, such as
SmolLM2's and Qwen2.5's text templates) the text parts are joined with ``"\\n"``; in the
"openai" format (templates that loop over content items, such as Qwen2.5-VL's) the list is
kept and ``None`` renders as no items.
"""

from __future__ import annotations

__all__ = ["CHAT_ROLES", "CONTENT_TYPES", "check_messages", "content_type", "to_string_content"]

#: Roles accepted in a message (OpenAI chat roles that the supported templates render).
CHAT_ROLES = ("system", "user", "assistant", "tool")
#: Message keys accepted besides ``role`` and ``content`` (OpenAI chat message fields that
#: templates may read).
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
#: A video item's options (qwen-vl-utils' message keys; ``sample_fps`` for a list of frames).
VIDEO_OPTIONS = {"fps", "nframes", "min_frames", "max_frames", "video_start", "video_end", "sample_fps",
                 "min_pixels", "max_pixels", "total_pixels"}
#: Content item type -> keys that item may carry.
CONTENT_TYPES = {
    "text": {"type", "text"},
    "image": {"type", "image", "min_pixels", "max_pixels", "longest_edge"},
    "image_url": {"type", "image_url", "min_pixels", "max_pixels", "longest_edge"},
    "video": {"type", "video", *VIDEO_OPTIONS},
    "video_url": {"type", "video_url", *VIDEO_OPTIONS},
}


def content_type(item: dict) -> str | None:
    """Type of a content item: its ``type``, else inferred from an ``image`` / ``image_url``
    / ``video`` / ``video_url`` / ``text`` key (qwen-vl-utils style items may omit ``type``);
    ``None`` if none applies."""
    if "type" in item:
        return item["type"]
    for key in ("image", "image_url", "video", "video_url", "text"):
        if key in item:
            return key
    return None


def _check_item(item, where: str) -> None:
    if not isinstance(item, dict):
        raise TypeError(f"{where} must be a dict, got {type(item).__name__}")
    kind = content_type(item)
    if kind not in CONTENT_TYPES:
        raise ValueError(f"{where}: content type {kind!r} is not supported (supported: {sorted(CONTENT_TYPES)})")
    unknown = sorted(str(k) for k in item if k not in CONTENT_TYPES[kind])
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} in a {kind!r} item; allowed: {sorted(CONTENT_TYPES[kind])}")
    if kind == "text" and not isinstance(item.get("text"), str):
        raise ValueError(f"{where}: a 'text' item needs a str 'text', got {item.get('text')!r}")
    url = item.get("video_url")
    if isinstance(url, dict) and sorted(str(k) for k in url if k != "url"):
        raise ValueError(f"{where}.video_url: unknown key(s) {sorted(str(k) for k in url if k != 'url')}; "
                         "allowed: ['url']")
    url = item.get("image_url")
    if isinstance(url, dict):
        extra = sorted(str(k) for k in url if k not in ("url", "detail"))
        if extra:
            raise ValueError(f"{where}.image_url: unknown key(s) {extra}; allowed: ['detail', 'url']")
        if url.get("detail", "auto") != "auto":
            raise ValueError(f"{where}.image_url.detail={url['detail']!r} is not supported; use 'auto' "
                             "(or max_pixels to bound the image)")


def check_messages(messages) -> None:
    """Validate chat messages; returns nothing, raises on the first problem.

    Raises:
        TypeError: ``messages`` is not a list of dicts, or content is not str / list / None.
        ValueError: empty list, a missing or unknown role, an unknown message key, a content
            item of an unknown type (``input_audio``, ...) or with an unknown key,
            an ``image_url.detail`` other than ``"auto"``. The message names the index.
    """
    if not isinstance(messages, list) or not messages:
        raise TypeError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        unknown = sorted(str(k) for k in message if k not in _MESSAGE_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_MESSAGE_KEYS)}")
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"{where}: role {message.get('role')!r} is not one of {list(CHAT_ROLES)}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise TypeError(f"{where}.content must be a str, a list of items or None, got {type(content).__name__}")
        for j, item in enumerate(content):
            _check_item(item, f"{where}.content[{j}]")


def to_string_content(messages: list[dict]) -> list[dict]:
    """Messages in vLLM's "string" content format: every content a str (text parts joined
    with ``"\\n"``, ``None`` -> ``""``). Call :func:`check_messages` first.

    Raises:
        ValueError: an image or video item (a text-only template cannot place it).
    """
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            kinds = [content_type(item) for item in content]
            if any(k != "text" for k in kinds):
                raise ValueError(f"messages[{i}]: image and video items need a vision-language model; "
                                 "this one is text-only")
            content = "\n".join(item["text"] for item in content)
        out.append({**message, "content": "" if content is None else content})
    return out
