"""The server on a tiny random Qwen2.5-VL against the in-process ``LLM`` on the same folder:
an image as a ``data:`` URI, a local file under ``--allowed-local-media-path`` and an
``http://`` URL (``--allow-http-images``, served by a local ``http.server``) give the
library's tokens for the same image; ``mm_processor_kwargs.max_pixels`` counts like
``mm_options``; bad images are 400s that leave 8 concurrent streams untouched."""

from __future__ import annotations

import base64
import functools
import http.server
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from atlas_vlm import SamplingParams
from helpers import IMAGES

pytestmark = [pytest.mark.server, pytest.mark.vlm]

PHOTO = IMAGES / "grace_hopper.jpg"


def data_uri(path) -> str:
    kind = "png" if str(path).endswith(".png") else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def image_msg(url: str, text: str = "Describe this image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def offline(llm, text: str = "Describe this image.", n: int = 8, mm_options=None, path=PHOTO):
    conv = [{"role": "user", "content": [{"type": "image", "image": str(path)}, {"type": "text", "text": text}]}]
    return llm.chat(conv, SamplingParams(temperature=0, max_tokens=n), mm_options=mm_options, use_tqdm=False)[0]


def ask(server, url: str, text: str = "Describe this image.", n: int = 8, **extra):
    return server.client().chat.completions.create(model="tiny-vl", messages=image_msg(url, text), max_tokens=n,
                                                   temperature=0, **extra)


@pytest.fixture(scope="module")
def http_images(tmp_path_factory):
    """A local HTTP server on 127.0.0.1 serving tests/data/images."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(IMAGES))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_data_uri_file_and_http_images_equal_the_library(vlm_server, vlm_llm, http_images):
    ref = offline(vlm_llm)
    for url in (data_uri(PHOTO), f"file://{PHOTO}", str(PHOTO), f"{http_images}/grace_hopper.jpg"):
        r = ask(vlm_server, url)
        assert r.choices[0].message.content == ref.text, url[:40]
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
    stream = vlm_server.client().chat.completions.create(model="tiny-vl", messages=image_msg(data_uri(PHOTO)),
                                                         max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text


def test_mm_processor_kwargs_max_pixels_equal_mm_options(vlm_server, vlm_llm):
    small = {"max_pixels": 16 * 28 * 28}
    ref = offline(vlm_llm, mm_options=small)
    r = ask(vlm_server, data_uri(PHOTO), extra_body={"mm_processor_kwargs": small})
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) < len(offline(vlm_llm, n=1).prompt_token_ids)
    assert r.choices[0].message.content == ref.text


@pytest.mark.parametrize("kwargs", [{"max_pixels": 20_000_000}, {"min_pixels": 20_000_000, "max_pixels": 20_000_000},
                                    {"min_pixels": 20_000_000}])
def test_mm_processor_kwargs_may_not_raise_the_servers_bounds(vlm_server, kwargs):
    """The server runs with --max-pixels 50176 (64 visual tokens); a request asking for more
    (a 1x1 PNG blown up to 2e7 pixels once froze every stream for 13 s) is a 400 naming the
    bound, answered before the image is decoded."""
    with pytest.raises(openai.BadRequestError) as e:
        ask(vlm_server, data_uri(IMAGES / "logo.png"), extra_body={"mm_processor_kwargs": kwargs})
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert "above this server's max_pixels 50176" in message or "must be <= max_pixels (50176)" in message


@pytest.mark.parametrize("url_of, status, words", [
    (lambda h: data_uri(IMAGES / "not_an_image.png"), 400, "not an image"),
    (lambda h: data_uri(IMAGES / "truncated.jpg"), 400, "truncated"),
    (lambda h: data_uri(IMAGES / "bomb_40000x40000.png"), 400, "decompression bomb"),
    (lambda h: data_uri(IMAGES / "coffee.png"), 400, "byte cap"),  # 466 KB > --max-image-bytes 300KiB
    (lambda h: "data:image/png;base64,@@@@", 400, "invalid base64"),
    (lambda h: f"{h}/coffee.png", 400, "byte cap"),
    (lambda h: f"{h}/missing.png", 400, "HTTP 404"),
    (lambda h: str(IMAGES / ".." / "helpers.py"), 400, "not under --allowed-local-media-path"),
    (lambda h: "/etc/hostname", 400, "not under --allowed-local-media-path"),
    (lambda h: "ftp://example.com/a.png", 400, "unsupported image URL scheme"),
])
def test_bad_images_are_400_naming_the_cause(vlm_server, http_images, url_of, status, words):
    with pytest.raises(openai.BadRequestError) as e:
        ask(vlm_server, url_of(http_images))
    assert e.value.status_code == status
    assert words in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"


def test_a_bad_image_leaves_8_concurrent_streams_unaffected(vlm_server, vlm_llm, tmp_path):
    questions = [f"Question {i}: what is in the picture?" for i in range(8)]
    refs = [offline(vlm_llm, q, n=12) for q in questions]
    started = threading.Barrier(9, timeout=300)
    client = vlm_server.client()

    def stream(q):
        chunks = client.chat.completions.create(model="tiny-vl", messages=image_msg(data_uri(PHOTO), q),
                                                max_tokens=12, temperature=0, stream=True)
        parts = []
        for i, c in enumerate(chunks):
            parts.append(c.choices[0].delta.content or "" if c.choices else "")
            if i == 0:
                started.wait()
        return "".join(parts)

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(stream, q) for q in questions]
        started.wait()  # all 8 are streaming
        with pytest.raises(openai.BadRequestError) as e:
            ask(vlm_server, data_uri(IMAGES / "truncated.jpg"))
        outside = tmp_path / "photo.jpg"
        shutil.copy(PHOTO, outside)
        with pytest.raises(openai.BadRequestError) as e2:
            ask(vlm_server, str(outside))
        texts = [f.result(timeout=300) for f in futures]
    assert "truncated" in e.value.body["message"] and "not under" in e2.value.body["message"]
    assert texts == [r.text for r in refs]
    m = vlm_server.metrics()
    assert m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]


# ---- video_url (vLLM's part) ---------------------------------------------------------------
VIDEOS = IMAGES.parent / "videos"
CLIP = VIDEOS / "frames_30fps_90.mp4"
VIDEO_KWARGS = {"min_pixels": 4 * 28 * 28, "max_pixels": 16 * 28 * 28}  # a few tokens per frame group


def video_uri(path) -> str:
    kind = "webm" if str(path).endswith(".webm") else "mp4"
    return f"data:video/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def video_msg(url: str, text: str = "What happens in the clip?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def offline_video(llm, text: str = "What happens in the clip?", n: int = 8, **video_options):
    item = {"type": "video", "video": str(CLIP), **VIDEO_KWARGS, **video_options}
    conv = [{"role": "user", "content": [item, {"type": "text", "text": text}]}]
    return llm.chat(conv, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0]


def ask_video(server, url: str, text: str = "What happens in the clip?", n: int = 8, **kwargs):
    return server.client().chat.completions.create(
        model="tiny-vl", messages=video_msg(url, text), max_tokens=n, temperature=0,
        extra_body={"mm_processor_kwargs": {**VIDEO_KWARGS, **kwargs}})


def test_video_url_data_uri_equals_the_library(vlm_server, vlm_llm):
    ref = offline_video(vlm_llm)
    r = ask_video(vlm_server, video_uri(CLIP))
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    slower = offline_video(vlm_llm, fps=1.0)  # mm_processor_kwargs.fps is the item's fps
    r1 = ask_video(vlm_server, video_uri(CLIP), fps=1.0)
    assert r1.usage.prompt_tokens == len(slower.prompt_token_ids) < len(ref.prompt_token_ids)
    assert r1.choices[0].message.content == slower.text


@pytest.mark.parametrize(("url_of", "words"), [
    (lambda: video_uri(VIDEOS / "not_a_video.mp4"), "not a video"),
    (lambda: "data:video/mp4;base64,AAAA", "not a video"),
    (lambda: str(VIDEOS / "frames_2fps_8.mp4"), "not under --allowed-local-media-path"),
])
def test_bad_videos_are_400_naming_the_video_while_streams_run(vlm_server, vlm_llm, url_of, words):
    ref = offline(vlm_llm, "Question: what is in the picture?", n=12)
    client = vlm_server.client()
    started = threading.Event()

    def stream():
        chunks = client.chat.completions.create(model="tiny-vl", messages=image_msg(data_uri(PHOTO),
                                                "Question: what is in the picture?"),
                                                max_tokens=12, temperature=0, stream=True)
        parts = []
        for c in chunks:
            parts.append(c.choices[0].delta.content or "" if c.choices else "")
            started.set()
        return "".join(parts)

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(stream)
        assert started.wait(300)
        with pytest.raises(openai.BadRequestError) as e:
            ask_video(vlm_server, url_of())
        assert future.result(timeout=300) == ref.text
    assert e.value.status_code == 400 and words in e.value.body["message"]
    m = vlm_server.metrics()
    assert m["atlas:num_kv_blocks_free"] == m["atlas:num_kv_blocks_total"]
