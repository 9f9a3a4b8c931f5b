"""Qwen3-VL image geometry: patch 16, smart_resize factor 32, mean/std 0.5.

Our preprocessing (qwen-vl-utils resize once, then the slow processor with do_resize=False
and an explicit patch_size) is cross-checked against HF's FAST Qwen2-VL image processor
configured as Qwen3-VL's preprocessor_config.json (the slow one ignores a constructor
``size``, transformers #42910, so it is no reference here).
"""

from __future__ import annotations

import pytest
from transformers import Qwen2VLImageProcessorFast

import mm_token_pipeline as mtp
from atlas_vlm.models.processor_settings import image_processor_settings
from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_IMAGE_MEAN, QWEN3_VL_IMAGE_STD
from helpers import IMAGES as IMAGE_DIR
from tiny_vlms import QWEN3_VL_PIX
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image

pytestmark = pytest.mark.vlm

IMAGES = ["chelsea.png", "grace_hopper.jpg", "strip_31x639.png", "rocket.jpg", "logo.png"]


@pytest.mark.parametrize("max_tokens", [64, 256, 1000])
def test_grid_equals_hf_fast_processor_and_bound_holds(max_tokens):
    max_pixels, min_pixels = max_tokens * QWEN3_VL_PIX, 4 * QWEN3_VL_PIX
    fast = Qwen2VLImageProcessorFast(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=list(QWEN3_VL_IMAGE_MEAN),
        image_std=list(QWEN3_VL_IMAGE_STD), size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    for name in IMAGES:
        image = mtp.load_image(IMAGE_DIR / name)
        ref = fast(images=[image], return_tensors="pt")
        ours = preprocess_image(image, min_pixels=min_pixels, max_pixels=max_pixels, patch_size=16,
                                    image_mean=QWEN3_VL_IMAGE_MEAN, image_std=QWEN3_VL_IMAGE_STD)
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist(), name
        assert ours.num_tokens <= max_tokens
        assert ours.pixel_values.shape == ref["pixel_values"].shape == (ours.grid_thw[1] * ours.grid_thw[2], 1536)
        # PIL vs torchvision bicubic: at most 2 grey levels apart (1 level = 1/127.5 after mean/std 0.5)
        assert (ours.pixel_values - ref["pixel_values"]).abs().max() <= 2.5 / 127.5, name


def test_released_defaults_follow_the_family():
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    q3 = image_processor_settings(None, Qwen3VLConfig())
    assert q3.preprocess_kwargs() == dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                                          image_mean=QWEN3_VL_IMAGE_MEAN, image_std=QWEN3_VL_IMAGE_STD)
    assert (q3.min_pixels, q3.max_pixels) == (65536, 16777216) and "released qwen3_vl defaults" in q3.source
    q25 = image_processor_settings(None, Qwen2_5_VLConfig())
    assert (q25.patch_size, q25.merge_size, q25.min_pixels, q25.max_pixels) == (14, 2, 3136, 12845056)
