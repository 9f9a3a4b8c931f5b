"""M-RoPE positions with videos: ``get_rope_index`` (Qwen2-VL, Qwen2.5-VL) and
``get_rope_index_qwen3_vl`` equal transformers 5.24's ``get_rope_index`` of each family.

HF's method only reads ``self.config`` and ``self.get_vision_position_ids``, so it is called on
a stand-in holding the family's config (no model is built). Random requests mix 0..3 images
and 1..3 videos of random grids and frame rates; real prompts come from ``build_prompt_ids``.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

import mm_token_pipeline as mtp
from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
from helpers import mm_token_type_ids
from atlas_vlm.models.qwen3_vl.mrope import get_rope_index_qwen3_vl
from mm_token_pipeline import decode_position, get_rope_index
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image
from atlas_vlm.models.qwen2_vl.prompt_ids import build_prompt_ids
from atlas_vlm.models.qwen2_vl.video_processor import preprocess_video

pytestmark = pytest.mark.vlm

IMG, VID, VS, VE = 151655, 151656, 151652, 151653


class HF:
    """``cls.get_rope_index`` bound to a stand-in ``self`` with ``config``."""

    def __init__(self, cls, config):
        self.cls, self.config = cls, config

    def get_vision_position_ids(self, *args, **kwargs):
        return self.cls.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, ids, **kwargs):
        t = torch.tensor([ids])
        pos, delta = self.cls.get_rope_index(self, t, mm_token_type_ids(t), **kwargs)
        return pos[:, 0], int(delta.reshape(-1)[0])


def text(rng, lo=0, hi=5):
    return [rng.randint(0, 151000) for _ in range(rng.randint(lo, hi))]


def random_request(rng: random.Random, qwen3: bool):
    """ids, image grids, video grids, second_per_grid_ts (float32) of a random mixed prompt."""
    ids, images, videos = text(rng, 1), [], []
    kinds = ["video"] * rng.randint(1, 3) + ["image"] * rng.randint(0, 3)
    rng.shuffle(kinds)
    for kind in kinds:
        h, w = 2 * rng.randint(1, 5), 2 * rng.randint(1, 5)
        if kind == "image":
            images.append((1, h, w))
            ids += [VS] + [IMG] * (h * w // 4) + [VE]
        else:
            t = rng.randint(1, 12)
            videos.append((t, h, w))
            if qwen3:  # outer wrapper, then per frame '<t seconds>' text + wrapped run
                ids += [VS] + sum(([11, 13, 17][: rng.randint(1, 3)] + [VS] + [VID] * (h * w // 4) + [VE]
                                   for _ in range(t)), []) + [VE]
            else:
                ids += [VS] + [VID] * (t * h * w // 4) + [VE]
        ids += text(rng)
    seconds = torch.tensor([2 / rng.choice([0.5, 1.0, 2.0, 3.0, 29.97 / 15, 2 * 30 / 89]) for _ in videos])
    return ids, images, videos, seconds


@pytest.mark.parametrize("tokens_per_second", [2, 25])
@pytest.mark.parametrize("seed", range(15))
def test_qwen2_5_vl_equals_hf(seed, tokens_per_second):
    ids, images, videos, seconds = random_request(random.Random(seed), qwen3=False)
    hf = HF(Qwen2_5_VLModel, Qwen2_5_VLConfig(vision_config={"tokens_per_second": tokens_per_second}))
    ref, ref_delta = hf(ids, image_grid_thw=torch.tensor(images).reshape(-1, 3) if images else None,
                        video_grid_thw=torch.tensor(videos), second_per_grid_ts=seconds)
    ours, delta = get_rope_index(ids, images, image_token_id=IMG, vision_start_token_id=VS, video_token_id=VID,
                                 video_grid_thw=videos, second_per_grid_ts=seconds.tolist(),
                                 tokens_per_second=tokens_per_second)
    assert torch.equal(ours, ref) and delta == ref_delta


@pytest.mark.parametrize("seed", range(15))
def test_qwen2_vl_equals_hf(seed):
    ids, images, videos, _ = random_request(random.Random(100 + seed), qwen3=False)
    ref, ref_delta = HF(Qwen2VLModel, Qwen2VLConfig())(
        ids, image_grid_thw=torch.tensor(images).reshape(-1, 3) if images else None,
        video_grid_thw=torch.tensor(videos))
    ours, delta = get_rope_index(ids, images, image_token_id=IMG, vision_start_token_id=VS, video_token_id=VID,
                                 video_grid_thw=videos)
    assert torch.equal(ours, ref) and delta == ref_delta


@pytest.mark.parametrize("seed", range(15))
def test_qwen3_vl_equals_hf(seed):
    ids, images, videos, _ = random_request(random.Random(200 + seed), qwen3=True)
    ref, ref_delta = HF(Qwen3VLModel, Qwen3VLConfig())(
        ids, image_grid_thw=torch.tensor(images).reshape(-1, 3) if images else None,
        video_grid_thw=torch.tensor(videos))
    ours, delta = get_rope_index_qwen3_vl(ids, images, videos, image_token_id=IMG, video_token_id=VID,
                                          vision_start_token_id=VS)
    assert torch.equal(ours, ref) and delta == ref_delta


def test_qwen2_5_literal_text_after_video_starts_at_max_hw():
    ids = [5, VS] + [VID] * 4 + [VE, 6]  # grid (4, 2, 2) in patches: 4 groups of 1 token
    pos, delta = get_rope_index(ids, [], image_token_id=IMG, vision_start_token_id=VS, video_token_id=VID,
                                video_grid_thw=[(4, 2, 2)], second_per_grid_ts=[1.0], tokens_per_second=2)
    assert pos[0].tolist() == [0, 1, 2, 4, 6, 8, 3, 4]  # t: 2 + int(i * 2), i = 0..3; then 2 + max(1, 1)
    assert pos[1].tolist() == pos[2].tolist() == [0, 1, 2, 2, 2, 2, 3, 4]
    assert delta == 9 - 8 and decode_position(8, delta) == 9  # max(positions) + 1, the video's last group


@pytest.mark.parametrize("qwen3", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_real_prompt_equals_hf(qwen3):
    from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    geometry = dict(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3) if qwen3 else {}
    px = 1024 if qwen3 else 784
    clip = mtp.load_video("tests/data/videos/frames_30fps_90.mp4")
    video = preprocess_video(clip, min_pixels=16 * px, max_pixels=40 * px, **geometry)
    image = preprocess_image(mtp.load_image("tests/data/images/chelsea.png"), max_pixels=30 * px, **geometry)
    messages = [{"role": "user", "content": [{"type": "video", "video": "v"}, {"type": "text", "text": "and"},
                                             {"type": "image", "image": "i"}, {"type": "text", "text": "?"}]}]
    ids = build_prompt_ids(tok, messages, [video, image], video_timestamps=qwen3,
                               default_template=QWEN3_VL_CHAT_TEMPLATE if qwen3 else None)
    grids = dict(image_grid_thw=torch.tensor([image.grid_thw]), video_grid_thw=torch.tensor([video.grid_thw]))
    if qwen3:
        ref, ref_delta = HF(Qwen3VLModel, Qwen3VLConfig())(ids, **grids)
        ours, delta = get_rope_index_qwen3_vl(ids, [image.grid_thw], [video.grid_thw], image_token_id=IMG,
                                              video_token_id=VID, vision_start_token_id=VS)
    else:
        ref, ref_delta = HF(Qwen2_5_VLModel, Qwen2_5_VLConfig(vision_config={"tokens_per_second": 2}))(
            ids, second_per_grid_ts=torch.tensor([video.second_per_grid_t]), **grids)
        ours, delta = get_rope_index(ids, [image.grid_thw], image_token_id=IMG, vision_start_token_id=VS,
                                     video_token_id=VID, video_grid_thw=[video.grid_thw],
                                     second_per_grid_ts=[video.second_per_grid_t], tokens_per_second=2)
    assert video.grid_thw[0] == 3 and torch.equal(ours, ref) and delta == ref_delta


def test_errors_name_the_modality():
    with pytest.raises(ValueError, match="expected 4 video tokens"):
        get_rope_index([VS, VID, VID, 1], [], image_token_id=IMG, vision_start_token_id=VS, video_token_id=VID,
                       video_grid_thw=[(1, 4, 4)])
    with pytest.raises(ValueError, match="1 video_grid_thw entries but 0 video runs"):
        get_rope_index([1, 2], [], image_token_id=IMG, vision_start_token_id=VS, video_token_id=VID,
                       video_grid_thw=[(2, 4, 4)])
    with pytest.raises(ValueError, match="without video_token_id"):
        get_rope_index([1], [], image_token_id=IMG, vision_start_token_id=VS, video_grid_thw=[(2, 4, 4)])
    with pytest.raises(ValueError, match="2 second_per_grid_ts for 1 video_grid_thw"):
        get_rope_index([1], [], image_token_id=IMG, vision_start_token_id=VS, video_token_id=VID,
                       video_grid_thw=[(2, 4, 4)], second_per_grid_ts=[1.0, 1.0], tokens_per_second=2)
    with pytest.raises(ValueError, match="video token at index 13 but only 2 video_grid_thw"):  # per frame
        get_rope_index_qwen3_vl([VS] + [VID] * 4 + [VE, VS] + [VID] * 4 + [VE, VS] + [VID] * 4, [], [(2, 4, 4)],
                                image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)
