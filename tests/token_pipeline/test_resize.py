"""Tests of mm_token_pipeline.smart_resize and preprocess_image.

Cases C02, C03a, C03b of /work/shared/cases/cases.json (expected values copied here), the
qwen-vl-utils rules as a hypothesis property, and the agreement between our resize and
the grid of HF transformers' Qwen2VLImageProcessor.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from qwen_vl_utils.vision_process import smart_resize as qvu_smart_resize

from helpers import IMAGES
from mm_token_pipeline import ImageInputError, load_image, smart_resize
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image

pytestmark = pytest.mark.vlm

FACTOR = 28


def test_c02_thin_strip_clamped_to_one_tile():
    assert smart_resize(639, 31, max_pixels=20 * 28 * 28) == (560, 28)
    processed = preprocess_image(load_image(IMAGES / "strip_31x639.png"), max_pixels=20 * 28 * 28)
    assert processed.resized_hw == (560, 28)
    assert processed.grid_thw == (1, 40, 2)
    assert processed.num_tokens == 20


def test_c03a_aspect_ratio_exactly_200_accepted():
    processed = preprocess_image(load_image(IMAGES / "aspect_200.png"))
    assert processed.resized_hw == (28, 5600)
    assert processed.grid_thw == (1, 2, 400)
    assert processed.num_tokens == 200


def test_c03b_aspect_ratio_201_refused_naming_limit():
    image = load_image(IMAGES / "aspect_201.png")
    with pytest.raises(ImageInputError, match="200") as err:
        preprocess_image(image, source="aspect_201.png")
    assert "aspect ratio" in str(err.value) and "aspect_201.png" in str(err.value)
    with pytest.raises(ImageInputError, match="limit 200"):
        smart_resize(28, 5628)


def test_argument_errors_are_clear():
    with pytest.raises(ValueError, match="min_pixels"):
        smart_resize(100, 100, min_pixels=10_000, max_pixels=5_000)
    with pytest.raises(ValueError, match="height and width"):
        smart_resize(0, 100)
    with pytest.raises(ValueError, match="RGB"):
        preprocess_image(Image.new("L", (32, 32)))


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 4000),
    width=st.integers(1, 4000),
    max_tokens=st.integers(1, 2000),
    min_tokens=st.integers(0, 500),
)
def test_smart_resize_properties(height, width, max_tokens, min_tokens):
    max_pixels = max_tokens * FACTOR * FACTOR
    min_pixels = min(min_tokens * FACTOR * FACTOR, max_pixels)
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(ImageInputError, match="200"):
            smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        return
    h, w = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    assert h % FACTOR == 0 and w % FACTOR == 0 and h >= FACTOR and w >= FACTOR
    assert h * w <= max_pixels
    assert (h // FACTOR) * (w // FACTOR) <= max_pixels // (FACTOR * FACTOR)
    raw_h, raw_w = qvu_smart_resize(height, width, FACTOR, min_pixels=min_pixels, max_pixels=max_pixels)
    if raw_h >= FACTOR and raw_w >= FACTOR and raw_h * raw_w <= max_pixels:
        # qwen-vl-utils' result is kept whenever it is valid
        assert (h, w) == (raw_h, raw_w)
    if min_pixels <= max_pixels // 4 - FACTOR * FACTOR:
        # room for the floor/ceil steps: the lower bound holds too
        assert h * w >= min_pixels


@pytest.mark.parametrize("name", ["chelsea.png", "camera.png", "logo.png", "strip_31x639.png"])
def test_processor_grid_equals_resize(name):
    image = load_image(IMAGES / name)
    processed = preprocess_image(image, max_pixels=256 * 28 * 28)
    rh, rw = processed.resized_hw
    assert processed.grid_thw == (1, rh // 14, rw // 14)
    assert processed.num_tokens == rh * rw // (28 * 28) <= 256
    assert processed.pixel_values.dtype == torch.float32
    assert processed.pixel_values.shape == (rh * rw // (14 * 14), 3 * 2 * 14 * 14)


def test_features_match_qwen_vl_utils_resize_plus_hf_processor():
    from transformers import Qwen2VLImageProcessor

    image = load_image(IMAGES / "chelsea.png")
    processed = preprocess_image(image)
    rh, rw = processed.resized_hw
    ref = Qwen2VLImageProcessor(do_resize=False)(images=[image.resize((rw, rh))], return_tensors="pt")
    assert torch.equal(processed.pixel_values, ref["pixel_values"])
    assert processed.grid_thw == tuple(ref["image_grid_thw"][0].tolist()) == (1, 22, 32)
    assert processed.num_tokens == 176


def test_content_hash_identifies_pixels_and_size():
    image = load_image(IMAGES / "chelsea.png")
    a = preprocess_image(image)
    b = preprocess_image(load_image((IMAGES / "chelsea.png").read_bytes()))
    c = preprocess_image(image, max_pixels=64 * 28 * 28)
    d = preprocess_image(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    assert a.content_hash == b.content_hash
    assert len({a.content_hash, c.content_hash, d.content_hash}) == 3
