"""Tests of the Qwen-VL preprocess_video (models/qwen2_vl/video_processor.py) against qwen-vl-utils 0.0.14 and HF transformers.

Reference: qwen-vl-utils' own ``fetch_video`` (its per-frame bounds, ``smart_resize`` and
torchvision bicubic resize) fed with the frames ``load_video`` decodes (its reader backend
is replaced by one returning them: torchvision 0.29 has no ``read_video`` and decord is not
installed; the decoding itself is tested in test_video_io.py), then HF's video processor with
``do_resize=False`` as qwen-vl-utils' README calls it: ``Qwen2VLVideoProcessor`` (Qwen2-VL and
Qwen2.5-VL) and ``Qwen3VLVideoProcessor`` (patch 16, mean = std = 0.5). Every equality is exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from qwen_vl_utils import vision_process as qvu
from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

import mm_token_pipeline as mtp
from atlas_vlm.models.qwen2_vl.vision import VisionEncoder
from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_IMAGE_MEAN, QWEN3_VL_IMAGE_STD
from test_video_io import write_clip
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image
from atlas_vlm.models.qwen2_vl.video_processor import preprocess_video

pytestmark = pytest.mark.vlm

VIDEOS = Path(__file__).resolve().parent.parent / "data" / "videos"
PX14, PX16 = 28 * 28, 32 * 32
SMALL = dict(min_pixels=16 * PX14, max_pixels=64 * PX14)  # 16..64 tokens a frame: small tower inputs


def qwen_fetch_video(monkeypatch, video: mtp.VideoFrames, ele: dict, patch_size: int):
    """qwen-vl-utils ``fetch_video`` on ``video``'s decoded frames: ``(float [T, 3, h, w], metadata, sample_fps)``."""
    def reader(_ele):
        return torch.from_numpy(video.frames).permute(0, 3, 1, 2).contiguous(), video.qwen_metadata(), video.sample_fps

    monkeypatch.setitem(qvu.VIDEO_READER_BACKENDS, "torchvision", reader)
    monkeypatch.setattr(qvu, "get_video_reader_backend", lambda: "torchvision")
    (frames, meta), sample_fps = qvu.fetch_video({"video": str(video.source), **ele}, image_patch_size=patch_size,
                                                 return_video_sample_fps=True, return_video_metadata=True)
    return frames, meta, sample_fps


CASES = [
    ("frames_30fps_90.mp4", {}, {"max_pixels": 160 * PX14}),
    ("frames_30fps_90.mp4", {"fps": 4}, {"total_pixels": 12 * 200 * PX14, "min_pixels": 16 * PX14}),
    ("frames_2fps_8.mp4", {}, {"min_pixels": 8 * PX14, "max_pixels": 100 * PX14}),
    ("short_0.5s_30fps.mp4", {"nframes": 6}, {"max_pixels": 140 * PX14}),
    ("tall_vp9_10fps_20.webm", {}, {"max_pixels": 140 * PX14}),
]


@pytest.mark.parametrize("name, sampling, bounds", CASES)
def test_qwen2_features_equal_qwen_vl_utils_and_hf(monkeypatch, name, sampling, bounds):
    video = mtp.load_video(VIDEOS / name, **sampling)
    ref_frames, meta, sample_fps = qwen_fetch_video(monkeypatch, video, bounds, 14)
    ref = Qwen2VLVideoProcessor(do_resize=False, do_sample_frames=False, cap_pixels_per_frame=False)(
        videos=[ref_frames], return_tensors="pt")
    ours = preprocess_video(video, **bounds)
    assert ours.resized_hw == tuple(ref_frames.shape[-2:])
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    assert torch.equal(ours.pixel_values, ref["pixel_values_videos"])
    assert ours.pixel_values.shape == (ours.grid_thw[0] * ours.grid_thw[1] * ours.grid_thw[2], 1176)
    assert ours.num_tokens == ours.pixel_values.shape[0] // 4
    # temporal metadata: HF Qwen2.5-VL's second_per_grid_ts = temporal_patch_size / sampled_fps
    hf_meta = VideoMetadata(**{k: v for k, v in meta.items() if k != "video_backend"})
    assert ours.sample_fps == sample_fps == hf_meta.sampled_fps
    assert ours.second_per_grid_t == 2 / hf_meta.sampled_fps
    assert ours.frame_indices == meta["frames_indices"] and ours.modality == "video"


@pytest.mark.parametrize("name, sampling, bounds", CASES[:3])
def test_qwen3_features_and_timestamps_equal_hf(monkeypatch, name, sampling, bounds):
    bounds = {k: v * PX16 // PX14 for k, v in bounds.items()}
    video = mtp.load_video(VIDEOS / name, **sampling)
    ref_frames, meta, _ = qwen_fetch_video(monkeypatch, video, bounds, 16)
    ref = Qwen3VLVideoProcessor(do_resize=False, do_sample_frames=False, cap_pixels_per_frame=False)(
        videos=[ref_frames], return_tensors="pt")
    ours = preprocess_video(video, patch_size=16, image_mean=QWEN3_VL_IMAGE_MEAN, image_std=QWEN3_VL_IMAGE_STD,
                                **bounds)
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    assert torch.equal(ours.pixel_values, ref["pixel_values_videos"])
    assert ours.pixel_values.shape[1] == 3 * 2 * 16 * 16
    # HF Qwen3VLProcessor's timestamps (it does not use self), from the SOURCE fps
    expected = Qwen3VLProcessor._calculate_timestamps(None, list(meta["frames_indices"]), meta["fps"], 2)
    assert ours.timestamps == expected and len(ours.timestamps) == ours.grid_thw[0]


def test_timestamps_literal():
    video = mtp.load_video(VIDEOS / "frames_30fps_90.mp4")  # frames 0, 18, 36, 53, 71, 89 at 30 fps
    ours = preprocess_video(video, **SMALL)
    assert ours.frame_indices == [0, 18, 36, 53, 71, 89]
    assert ours.timestamps == pytest.approx([9 / 30, (36 + 53) / 60, (71 + 89) / 60], abs=1e-12)
    assert ours.second_per_grid_t == 1.0  # 2 frames / 2 fps


def test_content_hash_follows_frames_and_options():
    path = VIDEOS / "frames_30fps_90.mp4"
    a = preprocess_video(mtp.load_video(path), **SMALL)
    again = preprocess_video(mtp.load_video(path), **SMALL)
    assert a.content_hash == again.content_hash
    assert preprocess_video(mtp.load_video(path, fps=1), **SMALL).content_hash != a.content_hash
    bigger = preprocess_video(mtp.load_video(path), min_pixels=16 * PX14, max_pixels=200 * PX14)
    assert bigger.content_hash != a.content_hash
    other = mtp.load_video(VIDEOS / "frames_2fps_8.mp4", nframes=6)
    assert preprocess_video(other, **SMALL).content_hash != a.content_hash


def test_one_frame_gives_one_temporal_group(tmp_path):
    """A clip shorter than one sampling step: one temporal group, the frame repeated."""
    clip = mtp.load_video(write_clip(tmp_path / "one.mp4", 1))  # 1 frame: sampled [0, 0]
    ours = preprocess_video(clip, **SMALL)
    assert ours.grid_thw[0] == 1 and ours.frame_indices == [0, 0]
    assert ours.timestamps == [0.0] and ours.second_per_grid_t == 2 / clip.sample_fps
    cols = ours.pixel_values.view(-1, 3, 2, 14 * 14)  # columns: channel, temporal, 14 x 14
    assert torch.equal(cols[:, :, 0], cols[:, :, 1])
    # a list of one frame: qwen-vl-utils pads it to 2 and numbers them 0, 1 (fetch_video)
    listed = preprocess_video(mtp.load_video([Image.fromarray(clip.frames[0])], sample_fps=2.0), **SMALL)
    assert listed.grid_thw == ours.grid_thw and listed.frame_indices == [0, 1]
    assert listed.timestamps == [0.25] and listed.second_per_grid_t == 1.0


def test_encoder_takes_videos_as_hf_visual(tiny_models):
    hf = tiny_models["qwen2_5_vl"][1]
    encoder = VisionEncoder.from_state_dict(hf.config.vision_config, hf.model.visual.state_dict(), fast=False)
    fast = VisionEncoder.from_state_dict(hf.config.vision_config, hf.model.visual.state_dict())
    video = preprocess_video(mtp.load_video(VIDEOS / "frames_2fps_8.mp4", nframes=4), **SMALL)
    image = preprocess_image(Image.fromarray(mtp.load_video(VIDEOS / "frames_2fps_8.mp4").frames[0]),
                                 **SMALL)
    grid = torch.tensor([video.grid_thw])
    with torch.no_grad():
        ref = hf.model.get_video_features(video.pixel_values, grid).pooler_output[0]
    ours_video, ours_image = encoder.encode([video, image])
    assert ours_video.shape == (video.num_tokens, 64) and torch.equal(ours_video, ref)
    assert ours_image.shape[0] == image.num_tokens
    fast_video, fast_image = fast.encode([video, image])  # the fast tower: HF's within 1e-4
    assert fast.tower_kind == "fast"
    torch.testing.assert_close(fast_video, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(fast_image, ours_image, atol=1e-4, rtol=0)


def test_errors_name_the_input():
    with pytest.raises(mtp.VideoInputError, match="needs VideoFrames"):
        preprocess_video(torch.zeros(2, 8, 8, 3))
    video = mtp.load_video(VIDEOS / "frames_2fps_8.mp4", nframes=2)
    # a lone max_pixels lowers the default minimum, and 100 pixels hold no 28x28 tile
    with pytest.raises(mtp.VideoInputError, match=r"frames_2fps_8.mp4.*max_pixels \(100\) is below one 28x28 tile"):
        preprocess_video(video, max_pixels=100)
    with pytest.raises(mtp.VideoInputError, match="frames_2fps_8.mp4.*max_pixels=100 is below min_pixels=784"):
        preprocess_video(video, min_pixels=784, max_pixels=100)
