"""Chat messages of the OpenAI API to the engine's message form, with the server's image policy.

Scope: ``image_url`` parts become ``{"type": "image", "image": source}`` items. Sources:
``data:`` URIs always (decoded size capped); local files (``file://`` or a plain path)
only under ``--allowed-local-media-path``; ``http(s)://`` only with
``--allow-http-images``, fetched here with ``httpx`` (connect/read timeout, byte cap) so a
slow host never stalls the engine thread. Decoding the image itself (bombs, truncated
data) stays with ``mm_token_pipeline.load_image`` inside the engine. Policy as vLLM's
``--allowed-local-media-path`` and ``MediaConnector``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx

from atlas_vlm.entrypoints.openai.protocol import APIError, ChatMessage


@dataclass
class MediaPolicy:
    """Where images may come from (server flags)."""

    allowed_local_media_path: str | None = None  # folder; None: no local files
    allow_http_images: bool = False
    http_timeout_s: float = 10.0  # connect and read timeout of one image download (seconds)
    max_image_bytes: int = 20 * 2**20  # encoded size cap of one image (bytes), any source


def _local_path(url: str, policy: MediaPolicy, param: str) -> str:
    path = url[len("file://"):] if url.startswith("file://") else url
    if policy.allowed_local_media_path is None:
        raise APIError(400, f"{param}: local image files are refused; start the server with "
                       "--allowed-local-media-path DIR to serve files under DIR", param, "invalid_image")
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise APIError(400, f"{param}: local image {path!r} is not under --allowed-local-media-path {root}",
                       param, "invalid_image")
    if not os.path.isfile(real):
        raise APIError(400, f"{param}: local image {path!r} not found", param, "invalid_image")
    if os.path.getsize(real) > policy.max_image_bytes:
        raise APIError(400, f"{param}: image file is over the {policy.max_image_bytes}-byte cap", param,
                       "invalid_image")
    return real


async def _download(url: str, policy: MediaPolicy, param: str) -> bytes:
    if not policy.allow_http_images:
        raise APIError(400, f"{param}: http(s) image URLs are refused; start the server with "
                       "--allow-http-images to fetch them", param, "invalid_image")
    data = bytearray()
    try:
        async with httpx.AsyncClient(timeout=policy.http_timeout_s, follow_redirects=True) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise APIError(400, f"{param}: fetching {url} gave HTTP {resp.status_code}", param, "invalid_image")
                async for chunk in resp.aiter_bytes():
                    data += chunk
                    if len(data) > policy.max_image_bytes:
                        raise APIError(400, f"{param}: image at {url} is over the {policy.max_image_bytes}-byte cap",
                                       param, "invalid_image")
    except httpx.HTTPError as e:
        raise APIError(400, f"{param}: fetching {url} failed ({type(e).__name__}: {e})", param, "invalid_image") from e
    return bytes(data)


async def resolve_image(url: str, policy: MediaPolicy, param: str):
    """One ``image_url.url`` -> an image source for ``load_image`` (str or bytes).

    Raises:
        APIError(400): a refused or unreachable source, or one over ``max_image_bytes``.
    """
    if url.startswith("data:"):
        payload = url.split(",", 1)[1] if "," in url else ""
        if len(payload) * 3 // 4 > policy.max_image_bytes:
            raise APIError(400, f"{param}: data URI image is over the {policy.max_image_bytes}-byte cap",
                           param, "invalid_image")
        return url
    if url.startswith(("http://", "https://")):
        return await _download(url, policy, param)
    if "://" in url and not url.startswith("file://"):
        raise APIError(400, f"{param}: unsupported image URL scheme in {url[:40]!r}", param, "invalid_image")
    return _local_path(url, policy, param)


def _arguments(text: str):
    """A tool call's ``arguments`` JSON text as a dict for the template (kept as text if not JSON)."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def to_engine_messages(messages: list[ChatMessage], policy: MediaPolicy, is_vlm: bool) -> list[dict]:
    """OpenAI messages -> the engine's chat messages (role, content str or item list).

    A list of text parts only is joined with newlines into one string on a text-only model
    (as vLLM's "string" content format), since plain chat templates expect strings.
    """
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            items = []
            for j, part in enumerate(content):
                if part.type == "text":
                    items.append({"type": "text", "text": part.text})
                else:
                    src = await resolve_image(part.image_url.url, policy, f"messages.{i}.content.{j}.image_url")
                    items.append({"type": "image", "image": src})
            if not is_vlm and all(it["type"] == "text" for it in items):
                content = "\n".join(it["text"] for it in items)
            else:
                content = items
        msg = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:  # templates read arguments as a dict (Qwen: `tojson` otherwise)
            msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        for name in ("tool_call_id", "reasoning_content"):
            if getattr(m, name) is not None:
                msg[name] = getattr(m, name)
        out.append(msg)
    return out
