"""Video prompts: ``build_prompt_ids`` equals transformers 5.24's processors' ``input_ids``.

References: ``Qwen2_5_VLProcessor`` (Qwen2-VL / Qwen2.5-VL: ``num_tokens`` video pads; its
``second_per_grid_ts``) and ``Qwen3VLProcessor`` (one ``<t seconds><|vision_start|>pads
<|vision_end|>`` per temporal group inside the template's wrapper), each with the real Qwen2.5
tokenizer, our chat template, and HF's video processor given the frames qwen-vl-utils would
give (``preprocess_video``'s own resize, tested exact in test_video_processor.py) with
``do_resize=False``; images likewise already resized. Also ``extract_mm_items``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from PIL import Image
from transformers import (AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorFast, Qwen2VLVideoProcessor,
                          Qwen3VLProcessor, Qwen3VLVideoProcessor)

import mm_token_pipeline as mtp
from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
from atlas_vlm.models.qwen3_vl.mrope import get_rope_index_qwen3_vl
from helpers import IMAGES, VIDEO_PAD_ID
from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_CHAT_TEMPLATE, QWEN3_VL_IMAGE_MEAN, QWEN3_VL_IMAGE_STD
from mm_token_pipeline.video_processor import resize_frames
from test_video_processor import VIDEOS
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image
from atlas_vlm.models.qwen2_vl.prompt_ids import QWEN2_5_VL_CHAT_TEMPLATE, build_prompt_ids
from atlas_vlm.models.qwen2_vl.video_processor import preprocess_video

pytestmark = pytest.mark.vlm

VS, VE = 151652, 151653
BOUNDS = dict(min_pixels=16 * 28 * 28, max_pixels=48 * 28 * 28)
Q3 = dict(patch_size=16, image_mean=QWEN3_VL_IMAGE_MEAN, image_std=QWEN3_VL_IMAGE_STD)
Q3_BOUNDS = dict(min_pixels=16 * 32 * 32, max_pixels=48 * 32 * 32)
V1 = {"type": "video", "video": str(VIDEOS / "frames_30fps_90.mp4")}
V2 = {"type": "video_url", "video_url": {"url": str(VIDEOS / "frames_2fps_8.mp4")}}
IMG = {"type": "image", "image": str(IMAGES / "chelsea.png")}
TEXT = {"type": "text", "text": "What happens here?"}
CONVERSATIONS = {
    "video": [{"role": "user", "content": [V1, TEXT]}],
    "image_video": [{"role": "user", "content": [IMG, {"type": "text", "text": "and"}, V1, TEXT]}],
    "two_videos": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [V2, {"type": "text", "text": "then"}, V1, TEXT]}],
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def media(messages, qwen3: bool):
    """Ours (ProcessedImage / ProcessedVideo per item) and HF's inputs (resized images, frames, metadata)."""
    ours, images, videos, metas = [], [], [], []
    for modality, source, _ in mtp.extract_mm_items(messages):
        if modality == "image":
            pil = mtp.load_image(source)
            item = preprocess_image(pil, **(dict(Q3, min_pixels=4 * 1024) if qwen3 else {}))
            images.append(pil.resize(item.resized_hw[::-1], Image.Resampling.BICUBIC))
        else:
            clip = mtp.load_video(source)
            item = preprocess_video(clip, **(dict(Q3, **Q3_BOUNDS) if qwen3 else BOUNDS))
            videos.append(resize_frames(clip.frames, item.resized_hw))
            metas.append({k: v for k, v in clip.qwen_metadata().items() if k != "video_backend"})
        ours.append(item)
    return ours, images, videos, metas


def hf_processor(tokenizer, qwen3: bool):
    kwargs = dict(do_sample_frames=False, cap_pixels_per_frame=False)
    if qwen3:
        return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorFast(patch_size=16), tokenizer=tokenizer,
                                video_processor=Qwen3VLVideoProcessor(**kwargs), chat_template=QWEN3_VL_CHAT_TEMPLATE)
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorFast(), tokenizer=tokenizer,
                               video_processor=Qwen2VLVideoProcessor(**kwargs),
                               chat_template=QWEN2_5_VL_CHAT_TEMPLATE)


def hf_ids(processor, messages, images, videos, metas):
    hf_messages = [{**m, "content": [{"type": "video", "video": "v"} if c.get("type") == "video_url" else c
                                     for c in m["content"]]} if isinstance(m["content"], list) else m
                   for m in messages]
    text = processor.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(text=[text], images=images or None, videos=videos, video_metadata=metas, do_resize=False,
                        return_tensors="pt")
    return out


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("qwen3", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_ids_equal_hf_processor(tokenizer, name, qwen3):
    messages = CONVERSATIONS[name]
    ours, images, videos, metas = media(messages, qwen3)
    out = hf_ids(hf_processor(tokenizer, qwen3), messages, images, videos, metas)
    template = QWEN3_VL_CHAT_TEMPLATE if qwen3 else None
    ids = build_prompt_ids(tokenizer, messages, ours, default_template=template, video_timestamps=qwen3)
    assert ids == out["input_ids"][0].tolist()
    grids = [list(p.grid_thw) for p in ours if p.modality == "video"]
    assert out["video_grid_thw"].tolist() == grids
    assert ids.count(VIDEO_PAD_ID) == sum(p.num_tokens for p in ours if p.modality == "video")
    if not qwen3:
        ref = out["second_per_grid_ts"]  # float32, as HF's model receives it
        assert torch.equal(ref, torch.tensor([p.second_per_grid_t for p in ours if p.modality == "video"]))
    else:  # per temporal group: '<t seconds>' then a wrapped run, in place of the template's wrapper
        video = next(p for p in ours if p.modality == "video")
        text = tokenizer.decode(ids)
        assert f"<{video.timestamps[0]:.1f} seconds><|vision_start|><|video_pad|>" in text
        assert text.count("<|vision_start|>") == sum(p.grid_thw[0] if p.modality == "video" else 1 for p in ours)
        assert text.count("seconds>") == sum(p.grid_thw[0] for p in ours if p.modality == "video")


def test_extract_mm_items_in_prompt_order():
    messages = CONVERSATIONS["two_videos"] + [{"role": "user", "content": [IMG, V1]}]
    got = [(m, s) for m, s, _ in mtp.extract_mm_items(messages)]
    assert got == [("video", V2["video_url"]["url"]), ("video", V1["video"]), ("image", IMG["image"]),
                   ("video", V1["video"])]
    assert mtp.extract_image_items(messages) == [(IMG["image"], IMG)]
    with pytest.raises(ValueError, match=r"messages\[0\]: video item without a source"):
        mtp.extract_mm_items([{"role": "user", "content": [{"type": "video"}]}])


def test_count_and_order_errors(tokenizer):
    ours, *_ = media(CONVERSATIONS["image_video"], qwen3=False)
    messages = CONVERSATIONS["image_video"]
    with pytest.raises(ValueError, match="1 video placeholders but 0 videos were given"):
        build_prompt_ids(tokenizer, messages, ours[:1])
    with pytest.raises(ValueError, match=r"media order \['image', 'video'\], got \['video', 'image'\]"):
        build_prompt_ids(tokenizer, messages, ours[::-1])
    video = ours[1]
    assert torch.equal(torch.tensor(build_prompt_ids(tokenizer, CONVERSATIONS["video"], [video])).eq(
        VIDEO_PAD_ID).sum(), torch.tensor(video.num_tokens))


@pytest.mark.parametrize("qwen3", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_one_frame_clip_end_to_end(tokenizer, tmp_path, qwen3):
    """A clip shorter than one sampling step: one temporal group (the frame repeated), one
    timestamp, ids equal to HF's processor and positions equal to HF's get_rope_index."""
    from test_video_io import write_clip
    from test_video_mrope import HF
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    messages = [{"role": "user", "content": [{"type": "video", "video": str(write_clip(tmp_path / "one.mp4", 1))},
                                             TEXT]}]
    ours, images, videos, metas = media(messages, qwen3)
    video = ours[0]
    assert video.grid_thw[0] == 1 and video.frame_indices == [0, 0] and len(video.timestamps) == 1
    out = hf_ids(hf_processor(tokenizer, qwen3), messages, images, videos, metas)
    ids = build_prompt_ids(tokenizer, messages, ours, video_timestamps=qwen3,
                               default_template=QWEN3_VL_CHAT_TEMPLATE if qwen3 else None)
    assert ids == out["input_ids"][0].tolist()
    if qwen3:
        ref = HF(Qwen3VLModel, Qwen3VLConfig())(ids, video_grid_thw=out["video_grid_thw"])
        got = get_rope_index_qwen3_vl(ids, [], [video.grid_thw], image_token_id=151655, video_token_id=VIDEO_PAD_ID,
                                          vision_start_token_id=VS)
    else:
        ref = HF(Qwen2_5_VLModel, Qwen2_5_VLConfig())(ids, video_grid_thw=out["video_grid_thw"],
                                                      second_per_grid_ts=out["second_per_grid_ts"])
        got = mtp.get_rope_index(ids, [], image_token_id=151655, vision_start_token_id=VS, video_token_id=VIDEO_PAD_ID,
                                 video_grid_thw=[video.grid_thw], second_per_grid_ts=[video.second_per_grid_t],
                                 tokens_per_second=4)
    assert torch.equal(got[0], ref[0]) and got[1] == ref[1]
