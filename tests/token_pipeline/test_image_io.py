"""Tests of mm_token_pipeline.load_image: every input form, mode normalisation, bad files.

Cases C01, C04-C07 and C15 of /work/shared/cases/cases.json (expected values copied here).
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import numpy as np
import pytest
from PIL import Image

from helpers import IMAGES
from mm_token_pipeline import ImageInputError, load_image
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image

pytestmark = pytest.mark.vlm



def test_input_forms_give_identical_rgb():
    path = IMAGES / "chelsea.png"
    data = path.read_bytes()
    ref = np.asarray(load_image(str(path)))
    assert ref.shape == (300, 451, 3)
    forms = [
        path,
        f"file://{path}",
        "data:image/png;base64," + base64.b64encode(data).decode(),
        data,
        Image.open(path),
    ]
    for form in forms:
        image = load_image(form)
        assert image.mode == "RGB"
        assert np.array_equal(np.asarray(image), ref)


def test_http_refused_unless_allowed():
    with pytest.raises(ImageInputError, match="refused") as err:
        load_image("https://example.com/cat.png")
    assert "https://example.com/cat.png" in str(err.value)


@pytest.fixture()
def local_http_url():
    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(QuietHandler, directory=str(IMAGES))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_allowed_with_byte_limit(local_http_url):
    url = f"{local_http_url}/chelsea.png"
    image = load_image(url, allow_http=True, http_timeout_s=5.0)
    assert np.array_equal(np.asarray(image), np.asarray(load_image(IMAGES / "chelsea.png")))
    with pytest.raises(ImageInputError, match="max_http_bytes") as err:
        load_image(url, allow_http=True, max_http_bytes=1000)
    assert url in str(err.value)
    with pytest.raises(ImageInputError, match="download failed"):
        load_image(f"{local_http_url}/missing.png", allow_http=True)


def test_bad_data_uri_and_missing_file():
    with pytest.raises(ImageInputError, match="base64"):
        load_image("data:image/png;base64,@@@not base64@@@")
    with pytest.raises(ImageInputError, match="not found") as err:
        load_image(str(IMAGES / "no_such_file.png"))
    assert "no_such_file.png" in str(err.value)


def test_c01_animated_gif_first_frame():
    path = IMAGES / "no_time_for_that_tiny.gif"
    with Image.open(path) as raw:
        assert raw.n_frames == 24
        raw.seek(0)
        first = np.asarray(raw.convert("RGB"))
    image = load_image(path)
    assert image.mode == "RGB" and image.size == (14, 25)
    assert np.array_equal(np.asarray(image), first)
    processed = preprocess_image(image)
    assert processed.resized_hw == (84, 56)
    assert processed.grid_thw == (1, 6, 4)
    assert processed.num_tokens == 6


def test_c04_transparency_on_white():
    path = IMAGES / "half_transparent.png"
    with Image.open(path) as raw:
        stored = np.asarray(raw)
    right_rgb = tuple(int(v) for v in stored[0, 63, :3])
    assert right_rgb == (230, 10, 10)
    rgb = np.asarray(load_image(path))
    assert (rgb[:, :32] == (255, 255, 255)).all()
    assert (rgb[:, 32:] == right_rgb).all()
    processed = preprocess_image(load_image(path))
    assert (processed.resized_hw, processed.grid_thw, processed.num_tokens) == ((56, 56), (1, 4, 4), 4)


def test_c05_exif_orientation():
    image = load_image(IMAGES / "exif_orient6.jpg")
    assert image.size == (120, 320)
    top = np.asarray(image)[:10].reshape(-1, 3).mean(0)
    assert top[0] > 180 and top[1] < 60 and top[2] < 60
    processed = preprocess_image(image)
    assert (processed.resized_hw, processed.grid_thw, processed.num_tokens) == ((308, 112), (1, 22, 8), 44)


def test_c06_sixteen_bit_scaled_not_clipped():
    image = load_image(IMAGES / "gray16_ramp.png")
    rgb = np.asarray(image).astype(np.float64)
    assert abs(rgb.mean() - 127.5) <= 3
    assert not (rgb == 255).all()
    assert rgb[:, 0].max() == 0 and rgb[:, -1].min() == 255
    processed = preprocess_image(image)
    assert (processed.resized_hw, processed.grid_thw, processed.num_tokens) == ((56, 252), (1, 4, 18), 18)


def test_c07_cmyk_to_rgb():
    mean = np.asarray(load_image(IMAGES / "cmyk_red.jpg")).reshape(-1, 3).mean(0)
    assert np.all(np.abs(mean - np.array([255, 0, 0])) <= 30)


@pytest.mark.parametrize("mode", ["L", "1", "LA", "P", "I;16", "I;16B", "I", "RGBA", "CMYK"])
def test_every_mode_becomes_rgb(mode):
    base = Image.new("RGB", (20, 10), (40, 120, 200))
    if mode in ("I;16", "I;16B", "I"):
        arr = np.full((10, 20), 257 * 77, dtype={"I;16": "<u2", "I;16B": ">u2", "I": "<i4"}[mode])
        image = Image.frombytes(mode, (20, 10), arr.tobytes())  # [h, w] raw
        expected = (77, 77, 77)
    else:
        image = base.convert(mode)
        expected = tuple(np.asarray(image.convert("RGB"))[0, 0])
    out = load_image(image)
    assert out.mode == "RGB" and out.size == (20, 10)
    assert tuple(np.asarray(out)[0, 0]) == expected


def test_palette_transparency_composited_on_white():
    image = Image.new("P", (4, 4), 0)
    image.putpalette([0, 0, 0, 200, 0, 0] + [0] * 762)
    image.putpixel((0, 0), 1)
    image.info["transparency"] = 0
    out = np.asarray(load_image(image))
    assert tuple(out[0, 0]) == (200, 0, 0) and tuple(out[3, 3]) == (255, 255, 255)


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("zero_bytes.png", "empty"),
        ("truncated.jpg", "truncated"),
        ("not_an_image.png", "not an image"),
        ("bomb_40000x40000.png", "decompression bomb"),
    ],
)
def test_c15_bad_files_name_file_and_cause(name, cause):
    with pytest.raises(ImageInputError) as err:
        load_image(IMAGES / name)
    message = str(err.value)
    assert name in message and cause in message


def test_declared_size_limit_checked_before_decoding():
    buf = io.BytesIO()
    Image.new("RGB", (100, 100)).save(buf, format="PNG")
    with pytest.raises(ImageInputError, match="decompression bomb") as err:
        load_image(buf.getvalue(), max_image_pixels=5000)
    assert "bytes" in str(err.value)
