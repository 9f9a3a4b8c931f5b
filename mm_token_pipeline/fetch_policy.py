"""The one media fetch policy of the engine and the server, and the checks both apply.

Scope: ``MediaFetchPolicy`` (whether http(s) media are fetched, the timeout, the byte caps
of an image and of a video, the hosts allowed, the redirect bound) and the rules every
fetch obeys before it connects, whichever code reads the bytes:

- only ``http`` / ``https`` URLs with a host (``check_url``);
- with ``allowed_media_domains`` set, only the hosts named there;
- a host that is (or resolves to) a loopback, private, link-local, multicast, unspecified
  or otherwise non-global address is refused (``address_rule``, SSRF), unless the host is
  named in ``allowed_media_domains`` (``check_addresses``); the connection then goes to
  the address that was checked.

The bytes are read in two places with this policy: ``mm_token_pipeline.http_fetch.fetch_url``
(sync, the engine's loaders) and ``atlas_vlm.entrypoints.openai.media`` (async ``httpx``, the
server). A refusal is a ``MediaRefused`` (a ``ValueError``) whose ``code`` is the server's
OpenAI error code. Standard library only.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

__all__ = ["DEFAULT_HTTP_MAX_BYTES", "DEFAULT_HTTP_TIMEOUT_S", "DEFAULT_VIDEO_MAX_BYTES", "MediaFetchPolicy",
           "MediaRefused", "REFUSED_ADDRESS_CLASSES", "address_rule", "check_addresses", "check_url",
           "literal_address"]

#: Default timeout of one media download, in seconds.
DEFAULT_HTTP_TIMEOUT_S: float = 10.0
#: Default byte cap of one image (20 MiB).
DEFAULT_HTTP_MAX_BYTES: int = 20 * 2**20
#: Default byte cap of one video (64 MiB).
DEFAULT_VIDEO_MAX_BYTES: int = 64 * 2**20
#: The address classes a media fetch may never reach (unless its host is allow-listed).
REFUSED_ADDRESS_CLASSES = ("unspecified", "loopback", "link-local", "multicast", "private", "reserved", "non-global")


class MediaRefused(ValueError):
    """A media URL refused by the policy before any connection; ``code`` is the OpenAI
    error code the server answers with (``invalid_image``, ``media_domain_not_allowed``,
    ``media_address_refused``)."""

    def __init__(self, message: str, code: str = "invalid_image"):
        super().__init__(message)
        self.code = code


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class MediaFetchPolicy:
    """How http(s) media are fetched, by the engine (``EngineConfig.multimodal_config.media``,
    the flat ``LLM(...)`` keywords in brackets) and by the server (``--`` flags).

    Raises:
        ValueError: on creation, a field out of range (the message names its flat keyword).
    """

    allow_http_images: bool = False  # fetch http(s) image and video URLs (allow_http_images, --allow-http-images)
    # timeout of one download in seconds: the engine's fetch takes it as an overall deadline, the
    # server's httpx as its connect / read timeout (http_image_timeout_s, --image-fetch-timeout)
    http_timeout_s: float = DEFAULT_HTTP_TIMEOUT_S
    max_image_bytes: int = DEFAULT_HTTP_MAX_BYTES  # byte cap of one image (http_image_max_bytes, --max-image-bytes)
    max_video_bytes: int = DEFAULT_VIDEO_MAX_BYTES  # byte cap of one video (max_video_bytes, --max-video-bytes)
    # hosts fetched (exact names or IPs; such a host may resolve to a private address); None: any
    # host with a public address (allowed_media_domains, --allowed-media-domains)
    allowed_media_domains: list[str] | None = None
    max_redirects: int = 3  # redirect hops followed per download, each checked (max_redirects)

    def __post_init__(self) -> None:
        if not isinstance(self.allow_http_images, bool):
            raise ValueError(f"allow_http_images must be True or False, got {self.allow_http_images!r}")
        if not (isinstance(self.http_timeout_s, (int, float)) and self.http_timeout_s > 0):
            raise ValueError(f"http_image_timeout_s must be > 0 seconds, got {self.http_timeout_s!r}")
        if not _is_int(self.max_image_bytes) or self.max_image_bytes < 1:
            raise ValueError(f"http_image_max_bytes must be an int >= 1, got {self.max_image_bytes!r}")
        if not _is_int(self.max_video_bytes) or self.max_video_bytes < 1:
            raise ValueError(f"max_video_bytes must be an int >= 1, got {self.max_video_bytes!r}")
        if not _is_int(self.max_redirects) or self.max_redirects < 0:
            raise ValueError(f"max_redirects must be an int >= 0, got {self.max_redirects!r}")
        domains = self.allowed_media_domains
        if domains is not None:
            if isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains):
                raise ValueError(f"allowed_media_domains must be a list of host names or None, got {domains!r}")
            self.allowed_media_domains = list(domains)

    def max_bytes(self, kind: str) -> int:
        """Byte cap of one ``kind`` ("image" or "video") medium."""
        return self.max_video_bytes if kind == "video" else self.max_image_bytes

    def host_listed(self, host: str) -> bool:
        """Whether ``host`` is named in ``allowed_media_domains`` (case and a final dot ignored)."""
        names = {d.lower().rstrip(".") for d in self.allowed_media_domains or ()}
        return host.lower().rstrip(".") in names


def address_rule(address: str) -> str | None:
    """Why a media fetch may not connect to ``address`` (an IPv4 / IPv6 string): one of
    ``REFUSED_ADDRESS_CLASSES``, or None for a global (public) address. An IPv4-mapped IPv6
    address is judged as its IPv4 address.

    Raises:
        ValueError: ``address`` is not an IP address.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for name, hit in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                      ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                      ("private", ip.is_private), ("reserved", ip.is_reserved), ("non-global", not ip.is_global)):
        if hit:
            return name
    return None


def check_url(url: str, scheme: str, host: str | None, policy: MediaFetchPolicy) -> bool:
    """Check one hop's scheme and host (already parsed from ``url``) against ``policy``.

    Returns:
        Whether the host is named in ``allowed_media_domains`` (then its addresses are not
        checked by :func:`check_addresses`).

    Raises:
        MediaRefused: the scheme is not http(s), there is no host, or the host is not in
            ``allowed_media_domains`` (when that is set).
    """
    if scheme not in ("http", "https"):
        raise MediaRefused(f"image URL {url[:80]!r}: only http(s) may be fetched")
    if not host:
        raise MediaRefused(f"image URL {url[:80]!r} has no host")
    listed = policy.host_listed(host)
    if policy.allowed_media_domains is not None and not listed:
        raise MediaRefused(f"image host {host!r} is not in --allowed-media-domains {policy.allowed_media_domains}",
                           "media_domain_not_allowed")
    return listed


def literal_address(host: str) -> bool:
    """Whether ``host`` is an IP address itself (no lookup needed)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


def check_addresses(host: str, addresses: list[str], listed: bool) -> str:
    """The address to connect to for ``host``: the first of ``addresses`` once every one
    passes :func:`address_rule` (not checked when the host is ``listed``).

    Raises:
        MediaRefused: no address, or one of them is refused (the message names the rule
            and the address).
    """
    if not addresses:
        raise MediaRefused(f"image host {host!r} does not resolve")
    if not listed:
        for address in addresses:
            rule = address_rule(address)
            if rule is not None:
                raise MediaRefused(f"image host {host!r} resolves to {address}, {'an' if rule[0] in 'aeiou' else 'a'} "
                                   f"{rule} address; media fetches may only reach public addresses (name the host "
                                   f"in --allowed-media-domains to allow it)", "media_address_refused")
    return addresses[0]


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system's ``getaddrinfo``; an IP stays itself).

    Raises:
        MediaRefused: the host does not resolve.
    """
    if literal_address(host):
        return [host]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise MediaRefused(f"image host {host!r} does not resolve ({e})") from e
    return list(dict.fromkeys(info[4][0] for info in infos))
