"""Bounded HTTP(S) download for image URLs: an overall deadline and a byte cap.

Scope: ``fetch_url`` only. urllib's ``timeout`` bounds each socket operation, not the
whole download, so a server that drips one byte at a time (in the headers or the body)
could hold a request forever. Here a timer shuts the connection's socket down at the
deadline (``socket.shutdown`` wakes a blocked ``recv``), and the body is read in chunks
with a running byte count, so both limits hold whatever the server does.

Under a ``MediaFetchPolicy`` (``policy=``, the engine's) every connection, redirects
included, is checked first as the server's fetch is (``mm_token_pipeline.fetch_policy``:
http(s) only, ``allowed_media_domains``, no private addresses) and goes to the address
that was checked; no proxy from the environment is used and at most ``max_redirects``
redirects are followed.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.parse
import urllib.request

from .fetch_policy import MediaFetchPolicy, check_addresses, check_url, resolve

__all__ = ["DownloadError", "fetch_url"]

_CHUNK = 64 * 1024


class DownloadError(OSError):
    """A download failed, ran past its deadline or went over its byte cap."""


def _pinned(policy: MediaFetchPolicy):
    """A connection's ``create_connection`` that checks its host under ``policy`` and
    connects to the checked address (TLS still names the host)."""

    def create_connection(address, timeout, source_address=None):
        host, port = address
        listed = check_url(f"//{host}:{port}", "http", host, policy)
        target = check_addresses(host, resolve(host, port), listed)
        return socket.create_connection((target, port), timeout, source_address)

    return create_connection


def _recording_handlers(sockets: list, deadline: float, expired: threading.Event,
                        policy: MediaFetchPolicy | None = None):
    """urllib handlers whose connections (a redirect opens another) connect within what is
    left of ``deadline`` and append their socket to ``sockets``; one that connects after the
    cut-off is shut down at once. Under ``policy`` each host is checked and pinned, each
    redirect target checked, and at most ``policy.max_redirects`` redirects followed."""

    def connect(conn, base):
        conn.timeout = max(0.001, deadline - time.monotonic())
        if policy is not None:
            conn._create_connection = _pinned(policy)
        base.connect(conn)
        sockets.append(conn.sock)
        if expired.is_set():
            conn.sock.shutdown(socket.SHUT_RDWR)

    class _HTTP(http.client.HTTPConnection):
        def connect(self):
            connect(self, http.client.HTTPConnection)

    class _HTTPS(http.client.HTTPSConnection):
        def connect(self):
            connect(self, http.client.HTTPSConnection)

    class _HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(_HTTP, req)

    class _HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(_HTTPS, req)

    if policy is None:
        return _HTTPHandler(), _HTTPSHandler()

    class _Redirects(urllib.request.HTTPRedirectHandler):
        max_redirections = policy.max_redirects

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            parts = urllib.parse.urlsplit(newurl)
            check_url(newurl, parts.scheme, parts.hostname, policy)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    # ProxyHandler({}): no proxy from the environment (it would connect to a host never checked)
    return _HTTPHandler(), _HTTPSHandler(), _Redirects(), urllib.request.ProxyHandler({})


def fetch_url(url: str, *, timeout_s: float, max_bytes: int, policy: MediaFetchPolicy | None = None) -> bytes:
    """GET ``url`` (redirects followed) within ``timeout_s`` seconds overall and at most
    ``max_bytes`` bytes of body; under ``policy`` (``fetch_policy.MediaFetchPolicy``) each
    hop is checked first and pinned to its checked address (module docstring).

    Raises:
        ValueError: ``timeout_s`` not > 0 or ``max_bytes`` not >= 1.
        MediaRefused: (a ``ValueError``) under ``policy``, a hop refused before connecting.
        DownloadError: connection or HTTP error, the deadline passed (connecting, reading
            headers or body), or the body (declared or received) is over ``max_bytes``.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
    if policy is not None:
        parts = urllib.parse.urlsplit(url)
        check_url(url, parts.scheme, parts.hostname, policy)
    sockets: list[socket.socket] = []
    expired = threading.Event()

    def cut_off():
        expired.set()
        for s in list(sockets):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    deadline = time.monotonic() + timeout_s
    timer = threading.Timer(timeout_s, cut_off)
    timer.daemon = True
    timer.start()
    late = f"no complete answer within the overall deadline of {timeout_s} s (http_timeout_s)"
    try:
        opener = urllib.request.build_opener(*_recording_handlers(sockets, deadline, expired, policy))
        with opener.open(url, timeout=timeout_s) as resp:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise DownloadError(f"declared size {declared} bytes is over max_http_bytes={max_bytes}")
            data = bytearray()
            while True:
                if expired.is_set() or time.monotonic() >= deadline:
                    raise DownloadError(late)
                chunk = resp.read1(min(_CHUNK, max_bytes + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
                if len(data) > max_bytes:
                    raise DownloadError(f"body is over max_http_bytes={max_bytes}")
        if expired.is_set():  # the cut-off may end a read early with a short body
            raise DownloadError(late)
        return bytes(data)
    except DownloadError:
        raise
    except (OSError, http.client.HTTPException) as exc:
        raise DownloadError(late if expired.is_set() else f"download failed ({exc})") from exc
    finally:
        timer.cancel()
