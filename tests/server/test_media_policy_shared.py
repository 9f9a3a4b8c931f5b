"""One media fetch policy (issue 27): the engine's fetch (sync ``fetch_url`` under
``EngineConfig.multimodal_config.media``: ``load_image`` and the video ``_fetch`` of
``MediaInputs``) and the server's (async ``httpx``, ``MediaPolicy`` over the same policy)
refuse the same URLs for the same reason and fetch the same bytes; the serve flags become
that one policy.

Traffic: only to a 127.0.0.1 server started here; link-local targets are refused before any
connection."""

from __future__ import annotations

import asyncio
import functools
import http.server
import threading

import pytest

from atlas_vlm.config import EngineConfig
from atlas_vlm.inputs.media import MediaInputs
from atlas_vlm.entrypoints import cli
from atlas_vlm.entrypoints.openai.api_server import one_media_policy
from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args
from atlas_vlm.entrypoints.openai.media import MediaPolicy, resolve_image, resolve_media
from atlas_vlm.entrypoints.openai.protocol import APIError
from helpers import IMAGES
from mm_token_pipeline import ImageInputError, MultiModalOptions, load_image

pytestmark = [pytest.mark.server, pytest.mark.text]

PARAM = "messages.0.content.0.image_url"


class _Handler(http.server.SimpleHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Handler.hits.append(self.path)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/chelsea.png")
            self.end_headers()
            return
        super().do_GET()

    def copyfile(self, source, outputfile):
        try:
            super().copyfile(source, outputfile)
        except (BrokenPipeError, ConnectionResetError):  # a client that stopped at its byte cap
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(IMAGES)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def engine_image(config: EngineConfig, url: str):
    """The engine's image path: ``MediaInputs.media`` calls ``load_image`` with this policy."""
    return load_image(url, fetch_policy=config.multimodal_config.media)


def engine_video_bytes(config: EngineConfig, url: str) -> bytes:
    return MediaInputs(None, config, None, None, MultiModalOptions())._fetch(url)


def server_bytes(config: EngineConfig, url: str, kind: str = "image") -> bytes:
    policy = MediaPolicy.over(config.multimodal_config.media)
    return asyncio.run(resolve_media(url, policy, PARAM, kind))


@pytest.mark.parametrize(("kwargs", "path", "words"), [
    ({}, "http://{host}/chelsea.png", None),  # http off: each says so in its own words
    ({"allow_http_images": True}, "http://{host}/chelsea.png", "127.0.0.1, a loopback address"),
    ({"allow_http_images": True}, "http://localhost:{port}/chelsea.png", "a loopback address"),
    ({"allow_http_images": True}, "http://169.254.169.254/latest/meta-data", "a link-local address"),
    ({"allow_http_images": True, "allowed_media_domains": ["images.example"]}, "http://{host}/chelsea.png",
     "'127.0.0.1' is not in --allowed-media-domains"),
    ({"allow_http_images": True, "allowed_media_domains": ["127.0.0.1"]}, "http://{host}/redirect",
     "'localhost' is not in --allowed-media-domains"),
    ({"allow_http_images": True, "allowed_media_domains": ["127.0.0.1"], "http_image_max_bytes": 1000},
     "http://{host}/chelsea.png", "1000"),
])
def test_a_url_refused_by_one_is_refused_by_the_other(host, kwargs, path, words):
    config = EngineConfig(model="m", **kwargs)
    url = path.format(host=host, port=host.split(":")[1])
    _Handler.hits.clear()
    with pytest.raises(APIError) as served:
        server_bytes(config, url)
    with pytest.raises(ImageInputError) as engine:
        engine_image(config, url)
    assert served.value.status == 400
    if words is not None:
        assert words in served.value.message and words in str(engine.value)
    refused_before_connecting = words is None or "address" in words or "images.example" in str(kwargs)
    assert _Handler.hits == ([] if refused_before_connecting else [path.split("}")[1]] * 2)


def test_both_fetch_the_same_bytes_under_an_allow_list(host):
    config = EngineConfig(model="m", allow_http_images=True, allowed_media_domains=["127.0.0.1"])
    url = f"http://{host}/chelsea.png"
    data = (IMAGES / "chelsea.png").read_bytes()
    assert server_bytes(config, url) == data == engine_video_bytes(config, url)
    assert engine_image(config, url).size == load_image(str(IMAGES / "chelsea.png")).size
    loopback = EngineConfig(model="m", allow_http_images=True)  # no allow-list: the engine's video fetch refuses too
    with pytest.raises(ValueError, match="a loopback address"):
        engine_video_bytes(loopback, url)
    with pytest.raises(APIError, match="a loopback address"):
        asyncio.run(resolve_image(url, MediaPolicy.over(loopback.multimodal_config.media), PARAM))


def test_serve_flags_become_the_one_policy():
    args = cli.build_parser().parse_args([
        "serve", "m", "--allow-http-images", "--image-fetch-timeout", "2.5", "--max-image-bytes", "300KiB",
        "--max-video-bytes", "1MiB", "--allowed-media-domains", "a.example", "b.example",
        "--allowed-local-media-path", "/srv/media"])
    media = engine_config_from_args(args).multimodal_config.media
    assert (media.allow_http_images, media.http_timeout_s, media.max_image_bytes, media.max_video_bytes,
            media.allowed_media_domains) == (True, 2.5, 300 << 10, 1 << 20, ["a.example", "b.example"])
    served = MediaPolicy.over(media, allowed_local_media_path=args.allowed_local_media_path)
    assert served.fetch_policy() == media and served.allowed_local_media_path == "/srv/media"
    defaults = engine_config_from_args(cli.build_parser().parse_args(["serve", "m"])).multimodal_config.media
    assert defaults == EngineConfig(model="m").multimodal_config.media  # the flags' defaults are the engine's


def test_run_server_media_is_the_engines_policy_too():
    config = EngineConfig(model="m", allow_http_images=True, http_image_max_bytes=1000)
    same, media = one_media_policy(config)
    assert same is config and media.fetch_policy() == config.multimodal_config.media
    assert media.allowed_local_media_path is None
    given = MediaPolicy(allow_http_images=True, allowed_media_domains=["127.0.0.1"], allowed_local_media_path="/srv")
    engine, media = one_media_policy(EngineConfig(model="m", kvcache_block_size=32), given)
    assert media is given and engine.multimodal_config.media == given.fetch_policy()
    assert engine.cache_config.block_size == 32  # the rest of the config unchanged
