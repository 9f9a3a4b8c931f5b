"""SmolVLM2 video (atlas_vlm.models.smolvlm.video) against transformers 5.24's own path:
``SmolVLMProcessor.apply_chat_template(tokenize=True)`` on the same clip, its video processor
reading the file with transformers' PyAV reader (``video_utils.read_video_pyav``; the default
torchcodec is not installed here) and sampling with ``SmolVLMVideoProcessor.sample_frames``.
Ids, pixel values, masks and the sampled frame indices must be equal; each frame shows its
own index (tests/data/videos/README.md), so the decoded frames are checked too.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor
from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE
from transformers.video_utils import VideoMetadata
from transformers.video_utils import load_video as hf_load_video

from tiny_vlms import SMOLVLM_SEQ_LEN, SMOLVLM_TILE, smolvlm_tokenizer
from mm_token_pipeline import load_image
from atlas_vlm.models.smolvlm.prompt import SmolVLMTile, smolvlm_prompt
from atlas_vlm.models.smolvlm.video import (SmolVLMVideoFrame, load_smolvlm_video, smolvlm_sample_indices,
                                             smolvlm_video_prompt)
from mm_token_pipeline.video_sampling import VideoInputError

pytestmark = pytest.mark.vlm

VIDEOS = Path(__file__).resolve().parents[1] / "data" / "videos"
IMAGES = Path(__file__).resolve().parents[1] / "data" / "images"
CLIP30 = VIDEOS / "frames_30fps_90.mp4"  # 90 frames, 3.0 s
CLIP2 = VIDEOS / "frames_2fps_8.mp4"  # 8 frames, 4.0 s
SHORT = VIDEOS / "short_0.5s_30fps.mp4"  # 15 frames, 0.5 s
TALL = VIDEOS / "tall_vp9_10fps_20.webm"  # 20 frames, 2.0 s, 120 x 360
LONGEST_EDGE = 4 * SMOLVLM_TILE  # the tiny image processor's own size["longest_edge"]


def frame_index(img: np.ndarray) -> int:
    """The index a test clip's frame shows (tests/data/videos/README.md)."""
    h, w, _ = img.shape
    bw, bh = w // 4, h // 3
    return sum(1 << b for b in range(12)
               if img[(b // 4) * bh:(b // 4 + 1) * bh, (b % 4) * bw:(b % 4 + 1) * bw].mean() > 127)


@pytest.fixture(scope="module")
def proc():
    """A tiny SmolVLMProcessor: 64 px frames of 16 tokens; video_sampling as SmolVLM2's
    checkpoints state it (fps, max_frames, video_size), scaled down."""
    image_processor = SmolVLMImageProcessor(size={"longest_edge": LONGEST_EDGE},
                                            max_image_size={"longest_edge": SMOLVLM_TILE},
                                            image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = SmolVLMVideoProcessor(
        video_sampling={"fps": 1, "max_frames": 6, "video_size": {"longest_edge": 2 * SMOLVLM_TILE}},
        max_image_size={"longest_edge": SMOLVLM_TILE}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return SmolVLMProcessor(image_processor=image_processor, tokenizer=smolvlm_tokenizer(),
                            video_processor=video_processor, image_seq_len=SMOLVLM_SEQ_LEN,
                            chat_template=DEFAULT_CHAT_TEMPLATE)


def _hf_fetch(urls, sample_indices_fn=None):
    """``VideoProcessorMixin.fetch_videos`` with transformers' PyAV reader (not torchcodec)."""
    if isinstance(urls, list):
        return list(zip(*[_hf_fetch(u, sample_indices_fn) for u in urls]))
    return hf_load_video(urls, backend="pyav", sample_indices_fn=sample_indices_fn)


@pytest.fixture
def hf(proc, monkeypatch):
    """HF's own chat path: ``apply_chat_template(tokenize=True, return_dict=True)``."""
    monkeypatch.setattr(proc.video_processor, "fetch_videos", _hf_fetch)

    def run(content):
        return proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True, return_tensors="pt")

    return run


def _hf_indices(proc, path, **options) -> list[int]:
    """Frame indices transformers' PyAV reader takes with SmolVLM's ``sample_frames``."""
    vp = proc.video_processor
    fn = partial(vp.sample_frames, num_frames=options.get("num_frames", vp.num_frames),
                 fps=options.get("fps", vp.fps))
    video, meta = hf_load_video(str(path), backend="pyav", sample_indices_fn=fn)
    return [int(i) for i in meta.frames_indices], video


# ---------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("path, options, expected", [
    (CLIP30, {}, [0, 44, 89]),  # defaults fps 1, max 6: round(1 * 3.0) = 3 frames
    (CLIP30, {"fps": 2, "num_frames": 4}, [0, 29, 59, 89]),  # min(6, 4) = 4
    (CLIP30, {"fps": 0.5, "num_frames": 1}, [30]),  # 3 - 2 > 0.5: skip 1 s at both ends
    (CLIP2, {}, [0, 2, 4, 7]),  # 4 s at 1 fps
    (CLIP2, {"fps": 0.5, "num_frames": 2}, [2, 6]),  # 4 - 2 > 1: frames 2 .. 8 - 2
    (CLIP2, {"fps": 8, "num_frames": 64}, [0, 1, 2, 3, 4, 5, 6, 7]),  # 32 wanted, np.unique keeps 8
    (SHORT, {}, [0]),  # round(0.5) = 0 -> at least one frame
    (SHORT, {"fps": 30, "num_frames": 6}, [0, 2, 5, 8, 11, 14]),
])
def test_sampled_indices_and_frames_equal_transformers(proc, path, options, expected):
    ref_indices, ref_frames = _hf_indices(proc, path, **options)
    video = load_smolvlm_video(path, proc.video_processor, **options)
    assert video.frame_indices == ref_indices == expected
    assert np.array_equal(video.frames, ref_frames)  # the same decoded pixels as transformers' reader
    assert [frame_index(f) for f in video.frames] == expected
    assert video.fps == (2.0 if path == CLIP2 else 30.0)
    assert video.timestamps_s == [i / video.fps for i in expected]


def test_webm_samples_with_smolvlm_rule(proc):
    # transformers' PyAV reader reads the MP4-only declared frame count (0 for WebM); our
    # demux count feeds HF's own sample_frames
    video = load_smolvlm_video(TALL, proc.video_processor, fps=3, num_frames=5)
    meta = VideoMetadata(total_num_frames=20, fps=10.0, duration=2.0)
    ref = proc.video_processor.sample_frames(meta, num_frames=5, fps=3).tolist()
    assert video.frame_indices == ref == [0, 4, 9, 14, 19]  # min(round(3 * 2.0), 5) frames
    assert video.frames.shape == (5, 360, 120, 3)
    assert [frame_index(f) for f in video.frames] == ref
    assert video.duration_s == 2.0 and video.total_frames == 20


# ---------------------------------------------------------------------------- prompt and pixels


def _video_frames(items):
    return [i for i in items if i.modality == "video"]


def test_one_video_ids_and_pixels_equal_hf(proc, hf):
    ref = hf([{"type": "video", "path": str(CLIP30)}, {"type": "text", "text": "What happens?"}])
    messages = [{"role": "user", "content": [{"type": "video", "video": str(CLIP30)},
                                             {"type": "text", "text": "What happens?"}]}]
    ids, items = smolvlm_prompt(proc, messages, [], LONGEST_EDGE, videos=[str(CLIP30)])
    assert ids == ref["input_ids"][0].tolist()
    assert len(items) == ref["pixel_values"].shape[1] == 3
    for k, item in enumerate(items):
        assert isinstance(item, SmolVLMVideoFrame) and item.modality == "video" and SmolVLMTile.modality == "image"
        assert item.num_tokens == SMOLVLM_SEQ_LEN and item.grid_thw is None
        assert item.pixel_values.dtype == torch.float32 and item.pixel_values.shape == (3, SMOLVLM_TILE, SMOLVLM_TILE)
        assert torch.equal(item.pixel_values, ref["pixel_values"][0, k])
        assert torch.equal(item.pixel_attention_mask, ref["pixel_attention_mask"][0, k].bool())
        assert item.video_index == 0
    assert [i.frame_index for i in items] == [0, 44, 89]
    assert [i.timestamp_s for i in items] == [0.0, 44 / 30, 89 / 30]
    text = proc.tokenizer.decode(ids)
    assert "You are provided the following series of three frames from a 0:00:03 [H:MM:SS] video.\n" in text
    assert "\nFrame from 00:00:" in text and "\nFrame from 00:01:" in text and "\nFrame from 00:02:" in text
    assert sum(t == proc.image_token_id for t in ids) == 3 * SMOLVLM_SEQ_LEN


def test_video_and_image_in_one_prompt(proc, hf):
    pil = load_image(IMAGES / "chelsea.png")
    content = [{"type": "text", "text": "Compare "}, {"type": "image", "image": pil},
               {"type": "text", "text": " with"}, {"type": "video", "path": str(CLIP2)}]
    ref = hf(content)
    messages = [{"role": "user", "content": [dict(c, video=c.pop("path")) if c["type"] == "video" else c
                                             for c in [dict(c) for c in content]]}]
    video = load_smolvlm_video(CLIP2, proc.video_processor)
    ids, items = smolvlm_prompt(proc, messages, [pil], LONGEST_EDGE, videos=[video])
    assert ids == ref["input_ids"][0].tolist()
    # chelsea 451x300 at 256: 4x3 tiles + global view, then the video's 4 frames, in prompt order
    assert [i.modality for i in items] == ["image"] * 13 + ["video"] * 4
    frames = _video_frames(items)
    assert all(torch.equal(f.pixel_values, ref["pixel_values"][0, k]) for k, f in enumerate(frames))
    # HF returns the videos' pixel_values when given both; the tiles equal its image-only path
    ref_img = hf([{"type": "image", "image": pil}, {"type": "text", "text": "x"}])
    tiles = [i for i in items if i.modality == "image"]
    assert all(torch.equal(t.pixel_values, ref_img["pixel_values"][0, k]) for k, t in enumerate(tiles))
    assert all(torch.equal(t.pixel_attention_mask, ref_img["pixel_attention_mask"][0, k].bool())
               for k, t in enumerate(tiles))
    assert {t.image_index for t in tiles} == {0}
    # the same image alone through smolvlm_prompt's image path gives the same tiles
    _, alone = smolvlm_prompt(proc, [{"role": "user", "content": [{"type": "image"}]}], [pil], LONGEST_EDGE)
    assert [t.content_hash for t in alone] == [t.content_hash for t in tiles]


def test_two_videos_ids_pixels_and_hf_padding(proc, hf):
    content = [{"type": "video", "path": str(CLIP30)}, {"type": "text", "text": "and"},
               {"type": "video", "path": str(CLIP2)}]
    ref = hf(content)
    messages = [{"role": "user", "content": [{"type": "video", "video": "a"}, {"type": "text", "text": "and"},
                                             {"type": "video", "video": "b"}]}]
    ids, items = smolvlm_prompt(proc, messages, [], LONGEST_EDGE, videos=[str(CLIP30), str(CLIP2)])
    assert ids == ref["input_ids"][0].tolist()
    assert [(i.video_index, i.frame_index) for i in items] == [(0, 0), (0, 44), (0, 89),
                                                               (1, 0), (1, 2), (1, 4), (1, 7)]
    assert ref["pixel_values"].shape[:2] == (2, 4)  # HF pads the 3-frame video to 4 frames
    for item in items:
        k = [i.frame_index for i in items if i.video_index == item.video_index].index(item.frame_index)
        assert torch.equal(item.pixel_values, ref["pixel_values"][item.video_index, k])
    assert not ref["pixel_values"][0, 3].any()  # the padding frame: no item, HF's model drops it
    # each header names its own video's frames (3 and 4), the padding is pixels only
    text = proc.tokenizer.decode(ids)
    assert text.count("series of three frames") == 1 and text.count("series of four frames") == 1
    assert text.index("series of three frames") < text.index("series of four frames")
    assert text.count("Frame from") == 7


def test_items_fill_hf_image_features_in_order(proc, hf):
    """The tower on our items gives HF's ``get_image_features`` rows (which drop HF's padding
    frames) in the same order, so the engine's k-th <image> run gets HF's k-th features."""
    from transformers import SmolVLMConfig, SmolVLMModel

    from atlas_vlm.models.smolvlm.vision import SmolVLMVisionEncoder

    torch.manual_seed(0)
    config = SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=SMOLVLM_TILE, patch_size=8),
        scale_factor=2, image_token_id=proc.image_token_id)
    model = SmolVLMModel(config).eval()
    state = {k: v for k, v in model.state_dict().items() if k.startswith(("vision_model.", "connector."))}
    encoder = SmolVLMVisionEncoder.from_state_dict(config, state)
    ref = hf([{"type": "video", "path": str(CLIP30)}, {"type": "video", "path": str(SHORT)}])
    messages = [{"role": "user", "content": [{"type": "video", "video": "a"}, {"type": "video", "video": "b"}]}]
    _, items = smolvlm_prompt(proc, messages, [], LONGEST_EDGE, videos=[str(CLIP30), str(SHORT)])
    assert len(items) == 4  # 3 + 1 frames; HF pads the second video to 3
    with torch.no_grad():
        want = torch.cat(model.get_image_features(ref["pixel_values"], ref["pixel_attention_mask"]).pooler_output)
    got = torch.cat(encoder.encode(items))
    assert got.shape == want.shape == (4 * SMOLVLM_SEQ_LEN, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_frame_list_with_source_fps(proc):
    frames = [load_image(IMAGES / "chelsea.png")] * 3
    video = load_smolvlm_video(frames, proc.video_processor, source_fps=0.5)  # every frame, as HF takes lists
    assert video.frame_indices == [0, 1, 2] and video.duration_s == 6.0
    messages = [{"role": "user", "content": [{"type": "video", "video": frames}]}]
    ids, items = smolvlm_prompt(proc, messages, [], LONGEST_EDGE, videos=[video])
    ref = proc(text=proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}],
                                             add_generation_prompt=True, tokenize=False),
               videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="pt",
               videos_kwargs=dict(video_metadata=[dict(total_num_frames=3, fps=0.5, duration=6.0,
                                                       frames_indices=[0, 1, 2])], do_sample_frames=False))
    assert ids == ref["input_ids"][0].tolist()
    assert "Frame from 00:04:" in proc.tokenizer.decode(ids)  # frame 2 at 0.5 fps
    assert all(torch.equal(i.pixel_values, ref["pixel_values"][0, k]) for k, i in enumerate(items))


# ------------------------------------------------------------------------------------ hashes


def test_repeated_video_hashes_equal(proc):
    a = load_smolvlm_video(CLIP30, proc.video_processor)
    b = load_smolvlm_video(str(CLIP30), proc.video_processor)
    assert a.digest == b.digest
    messages = [{"role": "user", "content": [{"type": "video", "video": "a"}, {"type": "video", "video": "b"}]}]
    _, items = smolvlm_prompt(proc, messages, [], LONGEST_EDGE, videos=[a, b])
    first, second = items[:3], items[3:]
    assert [i.content_hash for i in first] == [i.content_hash for i in second]
    assert len({i.content_hash for i in first}) == 3  # one per frame
    other = load_smolvlm_video(CLIP30, proc.video_processor, fps=1, num_frames=2)  # other sampling
    assert other.digest != a.digest
    _, (o0, _o1) = smolvlm_video_prompt(proc, [{"role": "user", "content": [{"type": "video"}]}], [],
                                        LONGEST_EDGE, [other])
    assert o0.frame_index == first[0].frame_index == 0 and o0.content_hash != first[0].content_hash


# ------------------------------------------------------------------------------------ errors


def test_unknown_fps_and_zero_frames_name_the_video(proc):
    vp = proc.video_processor
    with pytest.raises(ValueError, match=r"clip\.mp4.*unknown fps"):
        smolvlm_sample_indices(vp, 30, None, source="clip.mp4")
    with pytest.raises(ValueError, match=r"clip\.mp4.*zero frames"):
        smolvlm_sample_indices(vp, 0, 30.0, source="clip.mp4")
    with pytest.raises(ValueError, match=r"frames.*unknown fps.*source_fps"):
        load_smolvlm_video([load_image(IMAGES / "chelsea.png")], vp)
    with pytest.raises(ValueError, match=r"frames.*zero frames"):
        load_smolvlm_video([], vp, source_fps=2)
    with pytest.raises(ValueError, match=r"not_a_video\.mp4.*not a readable video"):
        load_smolvlm_video(VIDEOS / "not_a_video.mp4", vp)
    with pytest.raises(ValueError, match=r"missing\.mp4.*file not found"):
        load_smolvlm_video(VIDEOS / "missing.mp4", vp)


def test_bad_options_and_mismatched_items(proc):
    vp = proc.video_processor
    for options, name in (({"fps": 0}, "fps=0"), ({"num_frames": 2.5}, "num_frames=2.5"),
                          ({"num_frames": True}, "num_frames=True"), ({"skip_secs": -1}, "skip_secs=-1")):
        with pytest.raises(ValueError, match=rf"frames_2fps_8\.mp4.*{name}"):
            load_smolvlm_video(CLIP2, vp, **options)
    bare = SmolVLMVideoProcessor(max_image_size={"longest_edge": SMOLVLM_TILE})  # no video_sampling
    with pytest.raises(ValueError, match=r"no num_frames given"):
        load_smolvlm_video(CLIP2, bare)
    assert load_smolvlm_video(CLIP2, bare, num_frames=2, fps=1).frame_indices == [0, 7]
    messages = [{"role": "user", "content": [{"type": "video", "video": str(CLIP2)}]}]
    with pytest.raises(ValueError, match="video items need their videos"):
        smolvlm_prompt(proc, messages, [], LONGEST_EDGE)
    url_item = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file://x.mp4"}}]}]
    with pytest.raises(ValueError, match="video items need their videos"):  # never read as empty text
        smolvlm_prompt(proc, url_item, [], LONGEST_EDGE)
    with pytest.raises(ValueError, match="1 video items but 2 videos"):
        smolvlm_prompt(proc, messages, [], LONGEST_EDGE, videos=[str(CLIP2), str(CLIP2)])
