"""Tests of atlas_vlm.models.qwen2_vl.vision.VisionEncoder against HF transformers' vision tower.

A tiny random ``Qwen2_5_VLForConditionalGeneration`` and ``Qwen2VLForConditionalGeneration``
(fp32, CPU, seed 0; every test runs for both): our encoder,
loaded from its ``visual`` state dict with ``fast=False`` (HF's tower: the reference), must
give bit-identical output to HF's ``model.model.visual`` on the same pixel values, for one
and for several images. Our fast tower (the default) is held to HF's within 1e-4 in
test_vision_fast.py.
"""

from __future__ import annotations


import pytest
import torch

from helpers import IMAGES
from atlas_vlm.models.qwen2_vl.vision import VisionEncoder
from mm_token_pipeline import load_image
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image

pytestmark = pytest.mark.vlm

MAX_PIXELS = 64 * 28 * 28  # keep the tower input small on CPU


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def hf_model(tiny_models, request):
    """The session's tiny random Qwen2.5-VL / Qwen2-VL (tests/conftest.py)."""
    return tiny_models[request.param][1]


@pytest.fixture(scope="module")
def encoder(hf_model):
    state = hf_model.model.visual.state_dict()
    return VisionEncoder.from_state_dict(hf_model.config.vision_config, state, dtype=torch.float32, device="cpu",
                                         fast=False)


@pytest.fixture(scope="module")
def images():
    names = ["chelsea.png", "no_time_for_that_tiny.gif", "camera.png"]
    return [preprocess_image(load_image(IMAGES / n), max_pixels=MAX_PIXELS) for n in names]


def test_single_image_identical_to_hf(hf_model, encoder, images):
    image = images[0]
    grid = torch.tensor([image.grid_thw])
    with torch.no_grad():
        ref = hf_model.model.visual(image.pixel_values, grid_thw=grid).pooler_output
        ours = encoder(image.pixel_values, [image.grid_thw])
    assert ours.shape == (image.num_tokens, 64)
    assert torch.equal(ours, ref)


def test_batched_images_identical_to_hf_and_split(hf_model, encoder, images):
    pixel_values = torch.cat([im.pixel_values for im in images])  # [sum patches, 1176]
    grid = torch.tensor([im.grid_thw for im in images])  # [3 images, 3]
    with torch.no_grad():
        ref = hf_model.model.visual(pixel_values, grid_thw=grid).pooler_output
    per_image = encoder.encode(images)
    assert [e.shape[0] for e in per_image] == [im.num_tokens for im in images]
    assert torch.equal(torch.cat(per_image), ref)
    with torch.no_grad():
        alone = encoder.encode([images[1]])[0]
    torch.testing.assert_close(alone, per_image[1], atol=1e-5, rtol=1e-5)


def test_config_forms_and_dtype(hf_model):
    state = hf_model.model.visual.state_dict()
    vision_dict = hf_model.config.vision_config.to_dict()
    for config in (hf_model.config, vision_dict):
        enc = VisionEncoder.from_state_dict(config, state, dtype=torch.float32, device="cpu")
        assert enc.dtype == torch.float32 and enc.device.type == "cpu"
    enc16 = VisionEncoder.from_state_dict(hf_model.config, state, dtype=torch.bfloat16, device="cpu")
    assert enc16.dtype == torch.bfloat16


def test_strict_load_lists_missing_and_unexpected(hf_model):
    state = dict(hf_model.model.visual.state_dict())
    prefixed = {f"visual.{k}": v for k, v in state.items()}
    with pytest.raises(ValueError, match="strip the 'visual.' prefix"):
        VisionEncoder.from_state_dict(hf_model.config.vision_config, prefixed, dtype=torch.float32, device="cpu")
    broken = dict(state)
    broken.pop("merger.ln_q.weight")
    broken["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \['merger.ln_q.weight'\]; unexpected keys \['extra.weight'\]"):
        VisionEncoder.from_state_dict(hf_model.config.vision_config, broken, dtype=torch.float32, device="cpu")
    wrong = dict(state)
    wrong["merger.ln_q.weight"] = torch.zeros(7)
    with pytest.raises(ValueError, match="does not fit"):
        VisionEncoder.from_state_dict(hf_model.config.vision_config, wrong, dtype=torch.float32, device="cpu")


def test_pixel_values_must_match_grid(encoder, images):
    with pytest.raises(ValueError, match="does not match grid_thw"):
        encoder(images[0].pixel_values[:-4], [images[0].grid_thw])


def test_tower_class_follows_the_vision_config(hf_model, encoder):
    """Qwen2-VL gets its own tower (no window attention), Qwen2.5-VL its windowed one: the
    same class as HF's ``model.visual``, from the config object and from its dict form."""
    assert type(encoder.model) is type(hf_model.model.visual)
    as_dict = VisionEncoder(hf_model.config.vision_config.to_dict())
    assert type(as_dict.model) is type(hf_model.model.visual)
    with pytest.raises(TypeError, match="vision_config must be"):
        VisionEncoder(42)
