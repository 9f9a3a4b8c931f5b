"""Media fetching cannot reach inside (issue 16): with ``--allow-http-images`` an image host
that is (or resolves to) a loopback, private, link-local, multicast or unspecified address
is refused before any connection, on the first hop and on every redirect hop, and
``--allowed-media-domains`` limits the hosts; each refusal names its rule.

Traffic: only to 127.0.0.1 servers these tests start. Private and link-local addresses are
checked by ``address_rule`` and ``check_fetch_target`` with a fake resolver, and the redirect
chain through ``httpx.MockTransport``, which sends nothing anywhere."""

from __future__ import annotations

import asyncio
import functools
import http.server
import threading

import httpx
import pytest

from atlas_vlm.entrypoints.openai.media import MediaPolicy, address_rule, check_fetch_target, resolve_image
from atlas_vlm.entrypoints.openai.protocol import APIError
from helpers import IMAGES
from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.vlm]

PARAM = "messages.0.content.0.image_url"


@pytest.mark.parametrize(("address", "rule"), [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"), ("fc00::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("::ffff:169.254.169.254", "link-local"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("100.64.0.1", "non-global"), ("93.184.216.34", None), ("2606:4700::1111", None), ("8.8.8.8", None),
])
def test_address_rule(address, rule):
    assert address_rule(address) == rule


def fake_resolver(table: dict[str, list[str]]):
    async def resolve(host: str, port: int) -> list[str]:
        host = host.rstrip(".")  # a fully qualified name, as getaddrinfo takes it
        if host not in table:
            raise OSError(f"fake resolver: no such host {host}")
        return table[host]
    return resolve


DNS = {"public.example": ["93.184.216.34"], "metadata.example": ["169.254.169.254"],
       "internal.example": ["10.0.0.7"], "mixed.example": ["93.184.216.34", "192.168.0.3"],
       "loop.example": ["127.0.0.1"]}


def check(url, **policy):
    return asyncio.run(check_fetch_target(url, MediaPolicy(allow_http_images=True, resolver=fake_resolver(DNS),
                                                           **policy), PARAM))


def test_a_public_host_is_pinned_to_its_checked_address():
    target, host = check("https://public.example:8443/a.png?x=1")
    assert str(target) == "https://93.184.216.34:8443/a.png?x=1" and host == "public.example"


@pytest.mark.parametrize(("url", "words"), [
    ("http://metadata.example/latest/meta-data", "resolves to 169.254.169.254, a link-local address"),
    ("http://internal.example/a.png", "resolves to 10.0.0.7, a private address"),
    ("http://mixed.example/a.png", "resolves to 192.168.0.3, a private address"),
    ("http://loop.example/a.png", "a loopback address"),
    ("http://169.254.169.254/latest", "a link-local address"),
    ("http://[::1]:8080/a.png", "a loopback address"),
    ("http://0.0.0.0/a.png", "an unspecified address"),
    ("http://224.0.0.1/a.png", "a multicast address"),
    ("http://nowhere.example/a.png", "does not resolve"),
    ("gopher://public.example/a", "only http(s)"),
])
def test_refused_targets_name_the_rule(url, words):
    with pytest.raises(APIError) as e:
        check(url)
    assert e.value.status == 400 and words in e.value.message and e.value.param == PARAM


def test_allowed_media_domains():
    with pytest.raises(APIError) as e:
        check("http://public.example/a.png", allowed_media_domains=["images.example"])
    assert "not in --allowed-media-domains" in e.value.message and e.value.code == "media_domain_not_allowed"
    target, _ = check("http://INTERNAL.example./a.png", allowed_media_domains=["internal.example"])
    assert target.host == "10.0.0.7"  # named by the operator: its private address is allowed


def test_every_redirect_hop_is_checked_before_connecting():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers["host"]))
        if request.url.path == "/start":
            return httpx.Response(302, headers={"location": "http://metadata.example/latest/meta-data"})
        return httpx.Response(200, content=b"secret")

    policy = MediaPolicy(allow_http_images=True, resolver=fake_resolver(DNS), transport=httpx.MockTransport(handler))
    with pytest.raises(APIError) as e:
        asyncio.run(resolve_image("http://public.example/start", policy, PARAM))
    assert "link-local" in e.value.message and "metadata.example" in e.value.message
    assert seen == [("http://93.184.216.34/start", "public.example")]  # the second hop was never requested


def test_redirects_are_bounded():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(302, headers={"location": "/again"})

    policy = MediaPolicy(allow_http_images=True, resolver=fake_resolver(DNS), transport=httpx.MockTransport(handler))
    with pytest.raises(APIError, match="more than 3 redirects"):
        asyncio.run(resolve_image("http://public.example/x", policy, PARAM))


# ---- through the server: only 127.0.0.1 servers started here ---------------------------------
class _Counting(http.server.SimpleHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Counting.hits.append(self.path)
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/chelsea.png")
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Counting, directory=str(IMAGES)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def chat_image(server, url):
    return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.name, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]})


def test_server_refuses_loopback_and_localhost_without_fetching(tiny_models, image_host):
    server = ServerProcess(str(tiny_models["qwen2"][0]), "--kv-cache-memory", "16MiB", "--allow-http-images",
                           name="tiny-qwen2")
    try:
        _Counting.hits.clear()
        port = image_host.split(":")[1]
        for url, words in ((f"http://{image_host}/chelsea.png", "127.0.0.1, a loopback address"),
                           (f"http://localhost:{port}/chelsea.png", "a loopback address")):
            r = chat_image(server, url)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert words in err["message"] and err["param"] == PARAM and err["code"] == "media_address_refused"
        assert _Counting.hits == []  # nothing reached the host
    finally:
        server.stop()


def test_allow_listed_host_is_fetched_and_its_redirect_to_another_host_refused(vlm_server, image_host):
    _Counting.hits.clear()
    r = chat_image(vlm_server, f"http://{image_host}/chelsea.png")
    assert r.status_code == 200, r.text
    r = chat_image(vlm_server, f"http://{image_host}/redirect")
    assert r.status_code == 400
    assert "'localhost' is not in --allowed-media-domains" in r.json()["error"]["message"]
    assert _Counting.hits == ["/chelsea.png", "/redirect"]  # the redirect target was never fetched
