"""Chat messages of the OpenAI API to the engine's message form, with the server's media policy.

Scope: ``image_url`` parts become ``{"type": "image", "image": source}`` items and
``video_url`` parts ``{"type": "video", "video": source}`` (vLLM's part), under one policy
(videos capped by ``max_video_bytes``). Sources:
``data:`` URIs always (decoded size capped); local files (``file://`` or a plain path)
only under ``--allowed-local-media-path``; ``http(s)://`` only with
``--allow-http-images``, fetched here with ``httpx`` (connect/read timeout, byte cap) so a
slow host never stalls the engine thread. Decoding the image itself (bombs, truncated
data) stays with ``mm_token_pipeline.load_image``, in the engine's input workers. Policy as
vLLM's ``--allowed-local-media-path``, ``--allowed-media-domains`` and ``MediaConnector``.

The http(s) rules are the engine's (one ``MediaFetchPolicy``, ``mm_token_pipeline.fetch_policy``:
the same timeout, byte caps, allowed hosts and address rule; the engine reads its bytes with
``fetch_url``, the server here with ``httpx``). Fetches cannot reach inside (SSRF): every hop's
host is resolved first and refused if any of its addresses is loopback, private, link-local,
multicast, unspecified or otherwise not global (``address_rule``), unless the host is named
in ``--allowed-media-domains``; the connection then goes to the address that was checked (no
second lookup to rebind), with the original ``Host`` and TLS server name. Redirects are followed by hand, at most
``max_redirects``, each hop checked the same way. With ``--allowed-media-domains`` only
the hosts named there are fetched.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields

import httpx

from atlas_vlm.entrypoints.openai.protocol import APIError, ChatMessage, printable
from mm_token_pipeline.fetch_policy import (REFUSED_ADDRESS_CLASSES, MediaFetchPolicy, MediaRefused, address_rule,
                                            check_addresses, check_url, literal_address)

__all__ = ["MediaPolicy", "REFUSED_ADDRESS_CLASSES", "address_rule", "check_fetch_target", "resolve_image",
           "resolve_media", "to_engine_messages"]

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP address strings


@dataclass
class MediaPolicy(MediaFetchPolicy):
    """Where images may come from (server flags): the engine's ``MediaFetchPolicy`` (http(s)
    fetches: timeout, byte caps, allowed hosts, redirects; ``EngineConfig.multimodal_config.media``)
    plus the server's own local-file rule.

    ``resolver`` (``(host, port) -> [ip, ...]``, default the system's ``getaddrinfo``) and
    ``transport`` (an ``httpx`` transport, default a real connection) exist so that tests
    can check the address rules without sending a packet anywhere.
    """

    allowed_local_media_path: str | None = None  # folder; None: no local files
    resolver: Resolver | None = None
    transport: httpx.AsyncBaseTransport | None = None

    @classmethod
    def over(cls, fetch: MediaFetchPolicy, **server) -> MediaPolicy:
        """The server's policy with ``fetch``'s fields (the engine's) and ``server``'s own
        (``allowed_local_media_path``, ``resolver``, ``transport``)."""
        return cls(**{f.name: getattr(fetch, f.name) for f in fields(MediaFetchPolicy)}, **server)

    def fetch_policy(self) -> MediaFetchPolicy:
        """The ``MediaFetchPolicy`` part (what the engine's own fetches obey)."""
        return MediaFetchPolicy(**{f.name: getattr(self, f.name) for f in fields(MediaFetchPolicy)})


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (``getaddrinfo`` in the event loop's executor)."""
    import asyncio

    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


async def check_fetch_target(url: str, policy: MediaPolicy, param: str) -> tuple[httpx.URL, str]:
    """Vet one hop of an image download (the rules of ``mm_token_pipeline.fetch_policy``, as
    the engine's fetch applies them).

    Returns:
        ``(URL to connect to, with the host replaced by the checked address; the original
        host name)``.

    Raises:
        APIError(400): the scheme is not http(s), the host is not in
            ``--allowed-media-domains``, it does not resolve, or one of its addresses is
            refused by ``address_rule`` (the message names the rule and the address).
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        raise APIError(400, f"{param}: invalid image URL {url[:80]!r} ({e})", param, "invalid_image") from e
    try:
        listed = check_url(url, parsed.scheme, parsed.host, policy)
        host = parsed.host
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        if literal_address(host):
            addresses = [host]
        else:
            try:
                addresses = await (policy.resolver or system_resolver)(host, port)
            except OSError as e:
                raise MediaRefused(f"image host {host!r} does not resolve ({e})") from e
        address = check_addresses(host, addresses, listed)
    except MediaRefused as e:
        raise APIError(400, f"{param}: {e}", param, e.code) from e
    return parsed.copy_with(host=address), host


def _local_path(url: str, policy: MediaPolicy, param: str, kind: str = "image") -> str:
    path = url[len("file://"):] if url.startswith("file://") else url
    code = f"invalid_{kind}"
    if policy.allowed_local_media_path is None:
        raise APIError(400, f"{param}: local {kind} files are refused; start the server with "
                       "--allowed-local-media-path DIR to serve files under DIR", param, code)
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise APIError(400, f"{param}: local {kind} {path!r} is not under --allowed-local-media-path {root}",
                       param, code)
    if not os.path.isfile(real):
        raise APIError(400, f"{param}: local {kind} {path!r} not found", param, code)
    if os.path.getsize(real) > policy.max_bytes(kind):
        raise APIError(400, f"{param}: {kind} file is over the {policy.max_bytes(kind)}-byte cap", param, code)
    return real


async def _download(url: str, policy: MediaPolicy, param: str, kind: str = "image") -> bytes:
    code, cap = f"invalid_{kind}", policy.max_bytes(kind)
    if not policy.allow_http_images:
        raise APIError(400, f"{param}: http(s) {kind} URLs are refused; start the server with "
                       "--allow-http-images to fetch them", param, code)
    data = bytearray()
    try:
        # trust_env=False: no proxy from the environment (it would connect to a host we never checked)
        async with httpx.AsyncClient(timeout=policy.http_timeout_s, follow_redirects=False, trust_env=False,
                                     transport=policy.transport) as client:
            for _hop in range(policy.max_redirects + 1):
                target, host = await check_fetch_target(url, policy, param)
                original = httpx.URL(url)
                extensions = {"sni_hostname": host} if original.scheme == "https" else {}
                request = client.build_request("GET", target, headers={"Host": original.netloc.decode("ascii")},
                                               extensions=extensions)
                resp = await client.send(request, stream=True)
                try:
                    if resp.is_redirect:
                        location = resp.headers.get("location", "")
                        url = str(original.join(location))
                        continue
                    if resp.status_code != 200:
                        raise APIError(400, f"{param}: fetching {url} gave HTTP {resp.status_code}", param, code)
                    async for chunk in resp.aiter_bytes():
                        data += chunk
                        if len(data) > cap:
                            raise APIError(400, f"{param}: {kind} at {url} is over the {cap}-byte cap", param, code)
                    return bytes(data)
                finally:
                    await resp.aclose()
            raise APIError(400, f"{param}: fetching the {kind} took more than {policy.max_redirects} redirects "
                           f"(last {url[:80]!r})", param, code)
    except httpx.HTTPError as e:
        raise APIError(400, f"{param}: fetching {url} failed ({type(e).__name__}: {printable(str(e))})", param,
                       code) from e


async def resolve_media(url: str, policy: MediaPolicy, param: str, kind: str = "image"):
    """One ``image_url.url`` / ``video_url.url`` -> a source for ``load_image`` /
    ``load_video`` (str or bytes); ``kind`` is "image" or "video" (its byte cap, its
    error code ``invalid_<kind>``).

    Raises:
        APIError(400): a refused or unreachable source, or one over the kind's byte cap.
    """
    code, cap = f"invalid_{kind}", policy.max_bytes(kind)
    if url.startswith("data:"):
        payload = url.split(",", 1)[1] if "," in url else ""
        if len(payload) * 3 // 4 > cap:
            raise APIError(400, f"{param}: data URI {kind} is over the {cap}-byte cap", param, code)
        return url
    if url.startswith(("http://", "https://")):
        return await _download(url, policy, param, kind)
    if "://" in url and not url.startswith("file://"):
        raise APIError(400, f"{param}: unsupported {kind} URL scheme in {url[:40]!r}", param, code)
    return _local_path(url, policy, param, kind)


async def resolve_image(url: str, policy: MediaPolicy, param: str):
    """:func:`resolve_media` for an image."""
    return await resolve_media(url, policy, param, "image")


def _arguments(text: str):
    """A tool call's ``arguments`` JSON text as a dict for the template (kept as text if not JSON)."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def to_engine_messages(messages: list[ChatMessage], policy: MediaPolicy, is_vlm: bool,
                             video_options: dict | None = None) -> list[dict]:
    """OpenAI messages -> the engine's chat messages (role, content str or item list).

    A list of text parts only is joined with newlines into one string on a text-only model
    (as vLLM's "string" content format), since plain chat templates expect strings.
    ``video_options`` (qwen-vl-utils keys: ``fps``, ``nframes``, ``total_pixels``, from the
    request's ``mm_processor_kwargs``) go on every video item.
    """
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            items = []
            for j, part in enumerate(content):
                if part.type == "text":
                    items.append({"type": "text", "text": part.text})
                elif part.type == "video_url":
                    src = await resolve_media(part.video_url.url, policy, f"messages.{i}.content.{j}.video_url",
                                              "video")
                    items.append({"type": "video", "video": src, **(video_options or {})})
                else:
                    src = await resolve_image(part.image_url.url, policy, f"messages.{i}.content.{j}.image_url")
                    items.append({"type": "image", "image": src})
            if not is_vlm and all(it["type"] == "text" for it in items):
                content = "\n".join(it["text"] for it in items)
            else:
                content = items
        # the prompt pipeline knows no "developer" role; OpenAI treats it as the system's instructions
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content if content is not None else ""}
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
