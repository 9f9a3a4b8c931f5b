"""Qwen3.5's vision tower (``atlas_vlm.models.qwen3_5.vision.Qwen3_5VisionEncoder``) against HF
transformers 5.25's ``Qwen3_5VisionModel`` on the same random weights: images of different
sizes and a video's frames (our own preprocessing, patch 16 / merge 2), fp32, within 1e-4.
Also: one feature per visual token (no DeepStack columns), a released checkpoint's
``vision_config`` dict loads, and bad configs / state dicts are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

import mm_token_pipeline as mtp
from atlas_vlm.models.qwen3_5.vision import Qwen3_5VisionEncoder
from helpers import IMAGES
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image
from atlas_vlm.models.qwen2_vl.video_processor import preprocess_video

pytestmark = pytest.mark.vlm

VIDEOS = IMAGES.parent / "videos"
PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
GEOMETRY = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, in_channels=3)


@pytest.fixture(scope="module")
def hf_tower():
    torch.manual_seed(0)
    tower = Qwen3_5VisionModel._from_config(Qwen3_5VisionConfig(**VISION), dtype=torch.float32).eval()
    with torch.no_grad():  # random init is std 0.02: scale up so a wrong rule shows above 1e-4
        for name, p in tower.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
    return tower


@pytest.fixture(scope="module")
def ours(hf_tower):
    return Qwen3_5VisionEncoder.from_hf_config(Qwen3_5Config(vision_config=VISION), hf_tower.state_dict())


def items():
    images = [preprocess_image(mtp.load_image(IMAGES / name), max_pixels=tokens * PX, min_pixels=4 * PX, **GEOMETRY)
              for name, tokens in (("chelsea.png", 40), ("grace_hopper.jpg", 24), ("strip_31x639.png", 30))]
    clip = mtp.load_video(VIDEOS / "frames_30fps_90.mp4")
    video = preprocess_video(clip, min_pixels=8 * PX, max_pixels=16 * PX, **GEOMETRY)
    return images + [video]


def test_images_and_video_frames_equal_hf(hf_tower, ours):
    batch = items()
    assert ours.tower_kind == "hf" and batch[-1].modality == "video" and batch[-1].grid_thw[0] > 1
    assert len({it.grid_thw for it in batch}) == len(batch)  # every item its own grid
    got = ours.encode(batch)
    with torch.no_grad():
        for item, rows in zip(batch, got):
            ref = hf_tower(item.pixel_values, grid_thw=torch.tensor([item.grid_thw])).pooler_output
            assert rows.shape == (item.num_tokens, VISION["out_hidden_size"])  # no DeepStack columns
            assert ref.abs().max() > 0.1  # features carry signal
            torch.testing.assert_close(rows, ref, atol=1e-4, rtol=0)


def test_batched_call_equals_one_by_one(ours):
    batch = items()
    together = ours.encode(batch)
    alone = [ours.encode([it])[0] for it in batch]
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_released_vision_config_dict_loads(hf_tower):
    released = dict(VISION, model_type="qwen3_5", deepstack_visual_indexes=[], hidden_act="gelu_pytorch_tanh",
                    initializer_range=0.02)  # as Qwen3.5 checkpoints write it
    enc = Qwen3_5VisionEncoder.from_state_dict(released, hf_tower.state_dict())
    assert isinstance(enc.config, Qwen3_5VisionConfig) and enc.config.depth == 3


def test_bad_inputs_are_refused_by_name(hf_tower):
    with pytest.raises(ValueError, match="no DeepStack"):
        Qwen3_5VisionEncoder.from_state_dict(dict(VISION, deepstack_visual_indexes=[0]), hf_tower.state_dict())
    state = dict(hf_tower.state_dict())
    state.pop("merger.linear_fc2.weight")
    with pytest.raises(ValueError, match=r"missing keys \['merger.linear_fc2.weight'\]"):
        Qwen3_5VisionEncoder.from_state_dict(VISION, state)
    prefixed = {f"visual.{k}": v for k, v in hf_tower.state_dict().items()}
    with pytest.raises(ValueError, match="strip the 'visual.' prefix"):
        Qwen3_5VisionEncoder.from_state_dict(VISION, prefixed)
    with pytest.raises(TypeError, match="Qwen3_5VisionConfig"):
        Qwen3_5VisionEncoder.from_state_dict(42, hf_tower.state_dict())


def test_the_registry_line_names_these_classes():
    """The qwen3_5 ``ModelFamily`` line carries this tower and Qwen3-VL's media inputs
    (timestamped videos, per-group video positions); the text-only ``Qwen3_5ForCausalLM`` line neither."""
    from atlas_vlm.models.qwen3_vl.inputs import Qwen3VLInputs
    from atlas_vlm.models.registry import get_family, import_named, resolve_family

    family = resolve_family(Qwen3_5Config(architectures=["Qwen3_5ForConditionalGeneration"]))
    assert family.name == "qwen3_5" and family.multimodal and family.mrope
    assert family.modalities == ("image", "video")
    assert import_named(family.vision_tower) is Qwen3_5VisionEncoder
    assert import_named(family.mm_inputs) is Qwen3VLInputs and Qwen3VLInputs.video_timestamps
    assert family.mrope_interleaved and family.default_mrope_section == (11, 11, 10)
    text = get_family("qwen3_5_text")
    assert text.architectures == ("Qwen3_5ForCausalLM",) and text.model_cls == family.model_cls
    assert (text.multimodal, text.vision_tower, text.mm_inputs, text.modalities) == (False, None, None, ())


@pytest.mark.parametrize("which", ["tiny", "released_default"])
def test_vision_param_count_equals_hf_on_meta(which):
    """``param_count.vision_params`` == HF's ``Qwen3_5VisionModel`` built on the meta device (no
    DeepStack mergers), and with the decoder's count the whole ``Qwen3_5ForConditionalGeneration``."""
    from transformers import Qwen3_5ForConditionalGeneration

    from atlas_vlm.models.param_count import text_params, vision_params

    config = Qwen3_5Config(vision_config=VISION) if which == "tiny" else Qwen3_5Config()
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(config)
    tower = sum(p.numel() for p in hf.model.visual.parameters())
    assert not hasattr(hf.model.visual, "deepstack_merger_list") and tower > 0
    assert vision_params(config) == tower
    assert text_params(config) + vision_params(config) == sum(p.numel() for p in hf.parameters())
