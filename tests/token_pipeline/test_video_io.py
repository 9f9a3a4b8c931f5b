"""Tests of mm_token_pipeline.video_io: probing, qwen-vl-utils 0.0.14 frame sampling, seeking,
input forms, frame lists, per-frame pixel bounds and bad input.

Every frame of the clips in tests/data/videos (and of those made here with PyAV's bundled
libx264) shows its own index as 12 bits (tests/data/videos/README.md), so each test reads the
index back from the decoded pixels and asserts exactly which frames were sampled. Expected
indices come from qwen-vl-utils' own pure functions (``calculate_video_frame_range``,
``smart_nframes``) and ``torch.linspace(start, end, n).round()`` as its decord reader does.
"""

from __future__ import annotations

import base64
import io
import math
import wave
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from qwen_vl_utils import vision_process as qvu

from mm_token_pipeline import video_decode
from mm_token_pipeline.video_io import (FRAME_FACTOR, VideoInputError, load_video, probe_video, sample_frame_indices,
                                        video_frame_bounds, video_resized_size)

pytestmark = pytest.mark.vlm

VIDEOS = Path(__file__).resolve().parent.parent / "data" / "videos"
CLIP90 = VIDEOS / "frames_30fps_90.mp4"


def frame_index(img: np.ndarray) -> int:
    """The index a frame shows (tests/data/videos/README.md)."""
    h, w, _ = img.shape
    bw, bh = w // 4, h // 3
    return sum(1 << b for b in range(12)
               if img[(b // 4) * bh:(b // 4 + 1) * bh, (b % 4) * bw:(b % 4 + 1) * bw].mean() > 127)


def shown(frames: np.ndarray) -> list[int]:
    return [frame_index(f) for f in frames]


def index_frame(i: int, w: int = 64, h: int = 48) -> np.ndarray:
    """An RGB frame showing index ``i`` in the README's 12-bit layout."""
    img = np.zeros((h, w, 3), np.uint8)
    bw, bh = w // 4, h // 3
    for b in range(12):
        if (i >> b) & 1:
            img[(b // 4) * bh:(b // 4 + 1) * bh, (b % 4) * bw:(b % 4 + 1) * bw] = 255
    return img


def write_clip(path: Path, n: int, fps: int = 30, *, gop: int | None = None, faststart: bool = False) -> Path:
    """Encode ``n`` index frames (64 x 48) with libx264 into ``path`` (MP4)."""
    options = {"qp": "10"}
    if gop is not None:
        options.update(g=str(gop), keyint_min=str(gop), sc_threshold="0")
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as out:
        stream = out.add_stream("libx264", rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(n):
            for packet in stream.encode(av.VideoFrame.from_ndarray(index_frame(i), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def qwen_expected(total: int, video_fps: float, opts: dict) -> tuple[list[int], float]:
    """qwen-vl-utils 0.0.14 ``_read_video_decord``'s indices and sample_fps for these options."""
    start, end, window = qvu.calculate_video_frame_range(opts, total, video_fps)
    n = qvu.smart_nframes(opts, total_frames=window, video_fps=video_fps)
    return torch.linspace(start, end, n).round().long().tolist(), n / max(window, 1e-6) * video_fps


# ----------------------------------------------------------------------------- probing


@pytest.mark.parametrize("name, frames, fps, duration, size, codec", [
    ("frames_30fps_90.mp4", 90, 30.0, 3.0, (320, 240), "h264"),
    ("frames_2fps_8.mp4", 8, 2.0, 4.0, (320, 240), "h264"),
    ("short_0.5s_30fps.mp4", 15, 30.0, 0.5, (320, 240), "h264"),
    ("tall_vp9_10fps_20.webm", 20, 10.0, 2.0, (120, 360), "vp9"),
])
def test_probe_states_the_readme_facts(name, frames, fps, duration, size, codec):
    probe = probe_video(VIDEOS / name)
    assert probe.total_frames == frames  # WebM declares no frame count: counted by demuxing
    assert probe.fps == fps and probe.fps_source == "average_rate"
    assert probe.duration_s == pytest.approx(duration, abs=1e-9)
    assert (probe.width, probe.height) == size
    assert probe.codec == codec
    assert probe.source == str(VIDEOS / name)


@pytest.mark.parametrize("name", ["frames_30fps_90.mp4", "frames_2fps_8.mp4", "short_0.5s_30fps.mp4",
                                  "tall_vp9_10fps_20.webm"])
def test_dense_sampling_decodes_exactly_the_sampled_frames(name):
    probe = probe_video(VIDEOS / name)
    n = probe.total_frames // 2 * 2  # the most frames nframes may ask (a multiple of 2; 15 -> 14)
    out = load_video(VIDEOS / name, nframes=n)
    expected = torch.linspace(0, probe.total_frames - 1, n).round().long().tolist()
    if n == probe.total_frames:
        assert expected == list(range(n))
    assert out.frame_indices == expected == shown(out.frames)
    assert out.frames.dtype == np.uint8 and out.frames.shape == (n, probe.height, probe.width, 3)


# ----------------------------------------------------------------------------- sampling = qwen-vl-utils


SAMPLING_CASES = [
    ("frames_30fps_90.mp4", {}, [0, 18, 36, 53, 71, 89]),                  # fps 2 default: 3 s -> 6
    ("frames_30fps_90.mp4", {"fps": 1}, [0, 30, 59, 89]),                  # 3 -> min_frames 4
    ("frames_30fps_90.mp4", {"fps": 4}, None),
    ("frames_30fps_90.mp4", {"fps": 30}, list(range(90))),
    ("frames_30fps_90.mp4", {"fps": 60}, list(range(90))),                 # capped at the clip's frames
    ("frames_30fps_90.mp4", {"fps": 10, "max_frames": 9}, [0, 13, 25, 38, 51, 64, 76, 89]),  # 30 -> floor(9) = 8
    ("frames_30fps_90.mp4", {"fps": 0.5, "min_frames": 9}, None),          # ceil(9) -> 10
    ("frames_30fps_90.mp4", {"nframes": 8}, [0, 13, 25, 38, 51, 64, 76, 89]),
    ("frames_30fps_90.mp4", {"nframes": 7}, None),                         # round_by_factor(7, 2) = 8
    ("frames_30fps_90.mp4", {"nframes": 5}, None),                         # round(2.5) * 2 = 4
    ("frames_30fps_90.mp4", {"video_start": 1.0, "video_end": 2.0}, [30, 40, 50, 60]),
    ("frames_30fps_90.mp4", {"video_start": 1.5}, None),
    ("frames_30fps_90.mp4", {"video_end": 0.5, "fps": 10}, None),
    ("frames_30fps_90.mp4", {"video_start": 0.51, "video_end": 2.49, "nframes": 6}, None),
    ("frames_2fps_8.mp4", {}, list(range(8))),
    ("frames_2fps_8.mp4", {"fps": 1}, [0, 2, 5, 7]),
    ("frames_2fps_8.mp4", {"video_start": 1.0, "video_end": 2.0}, [2, 4]),  # window of 3 -> max_frames 2
    ("short_0.5s_30fps.mp4", {}, [0, 5, 9, 14]),                           # 0.5 s: 1 frame at 2 fps -> min 4
    ("short_0.5s_30fps.mp4", {"nframes": 14}, None),
    ("tall_vp9_10fps_20.webm", {}, [0, 6, 13, 19]),
    ("tall_vp9_10fps_20.webm", {"fps": 5, "video_start": 0.45}, None),
]


@pytest.mark.parametrize("name, opts, literal", SAMPLING_CASES)
def test_sampled_frames_equal_qwen_vl_utils(name, opts, literal):
    out = load_video(VIDEOS / name, **opts)
    expected, sample_fps = qwen_expected(out.total_frames, out.fps, opts)
    if literal is not None:
        assert expected == literal  # the reference itself, spelled out
    assert out.frame_indices == expected
    assert shown(out.frames) == expected  # the pixels say which frames were decoded
    assert out.sample_fps == pytest.approx(sample_fps, rel=1e-12)
    assert out.num_frames == len(expected) and out.num_frames % FRAME_FACTOR == 0
    meta = out.qwen_metadata()
    assert meta["fps"] == out.fps and meta["frames_indices"] == expected
    assert meta["total_num_frames"] == out.sampling.end_frame - out.sampling.start_frame + 1


def test_sample_frame_indices_equal_qwen_on_a_grid():
    """The pure rule against qwen-vl-utils on clips that need no decoding (frames, fps)."""
    cases = 0
    for total, fps in [(2, 30.0), (3, 1.0), (17, 29.97), (250, 25.0), (1000, 24.0), (5000, 60.0)]:
        for opts in [{}, {"fps": 0.25}, {"fps": 3.5}, {"fps": 120}, {"min_frames": 32}, {"max_frames": 16},
                     {"fps": 8, "min_frames": 6, "max_frames": 40}, {"nframes": 2}, {"nframes": total},
                     {"video_start": 0.04}, {"video_end": total / fps / 2}, {"video_start": 0.1, "fps": 4}]:
            try:
                expected, sample_fps = qwen_expected(total, fps, opts)
            except ValueError:  # qwen-vl-utils refuses (e.g. a window under 2 frames): so do we
                with pytest.raises(VideoInputError):
                    sample_frame_indices(total, fps, **opts)
                continue
            got = sample_frame_indices(total, fps, **opts)
            assert got.indices == expected, (total, fps, opts)
            assert got.sample_fps == pytest.approx(sample_fps, rel=1e-12)
            cases += 1
    assert cases >= 60


def test_unknown_source_fps_is_stated_never_defaulted():
    with pytest.raises(VideoInputError, match="fps unknown.*fps sampling"):
        sample_frame_indices(90, None)
    with pytest.raises(VideoInputError, match="fps unknown.*video_start"):
        sample_frame_indices(90, None, nframes=4, video_start=1.0)
    got = sample_frame_indices(90, None, nframes=4)  # nframes needs no fps
    assert got.indices == [0, 30, 59, 89] and got.sample_fps is None


# ----------------------------------------------------------------------------- short clips


def test_one_frame_clip_gives_one_temporal_group(tmp_path):
    clip = write_clip(tmp_path / "one.mp4", 1)
    probe = probe_video(clip)
    assert (probe.total_frames, probe.fps) == (1, 30.0)
    assert load_video(clip).sample_fps == 60.0  # qwen-vl-utils' nframes / frames * fps = 2 / 1 * 30
    for opts in [{}, {"fps": 0.1}, {"nframes": 1}, {"nframes": 2}]:
        out = load_video(clip, **opts)
        assert out.frame_indices == [0, 0]  # the frame, repeated: FRAME_FACTOR frames
        assert out.frames.shape == (2, 48, 64, 3)
        assert shown(out.frames) == [0, 0]
        assert np.array_equal(out.frames[0], out.frames[1])
    with pytest.raises(VideoInputError, match=r"nframes=4 exceeds the clip's 1 frame"):
        load_video(clip, nframes=4)
    with pytest.raises(VideoInputError, match="video_start"):  # a window of one frame (qwen-vl-utils refuses)
        load_video(clip, video_start=0.0, video_end=1.0)


def test_clip_shorter_than_one_sampling_step():
    """0.5 s at 30 fps: fps=2 asks for 1 frame; min_frames 4 gives 4, spread over the clip."""
    out = load_video(VIDEOS / "short_0.5s_30fps.mp4", fps=2)
    assert out.frame_indices == [0, 5, 9, 14] and shown(out.frames) == [0, 5, 9, 14]
    assert out.sample_fps == pytest.approx(4 / 15 * 30)
    assert sample_frame_indices(1, 30.0).indices == [0, 0]
    two = sample_frame_indices(2, 30.0, fps=0.01)
    assert two.indices == [0, 1] and two.sample_fps == pytest.approx(30.0)


def test_vp9_webm_tall():
    out = load_video(VIDEOS / "tall_vp9_10fps_20.webm", fps=4)
    assert out.probe.codec == "vp9"
    assert out.frames.shape == (8, 360, 120, 3)
    assert out.frame_indices == [0, 3, 5, 8, 11, 14, 16, 19] == shown(out.frames)
    assert out.duration_s == 2.0 and out.sample_fps == pytest.approx(4.0)


# ----------------------------------------------------------------------------- seeking


def _count_decoded(monkeypatch) -> list[int]:
    counter = [0]
    real = video_decode._decode_packet

    def counting(packet):
        frames = real(packet)
        counter[0] += len(frames)
        return frames

    monkeypatch.setattr(video_decode, "_decode_packet", counting)
    return counter


def test_seeking_decodes_fewer_frames_than_the_file(monkeypatch):
    counter = _count_decoded(monkeypatch)
    out = load_video(CLIP90, nframes=2)  # frames 0 and 89; keyframes at 0, 30, 60
    assert out.probe.num_keyframes == 3
    assert shown(out.frames) == [0, 89]
    # frame 0, then a seek to the keyframe 60 and 60..89: 1 + 30 of the file's 90
    assert counter[0] == out.frames_decoded == 31


def test_seeking_costs_at_most_a_keyframe_interval_per_sample(monkeypatch, tmp_path):
    clip = write_clip(tmp_path / "long.mp4", 300, gop=15)  # 10 s, a keyframe every 15 frames, B-frames
    assert probe_video(clip).num_keyframes == 20
    counter = _count_decoded(monkeypatch)
    out = load_video(clip, fps=1)
    expected, _ = qwen_expected(300, 30.0, {"fps": 1})
    assert out.frame_indices == expected == shown(out.frames)
    assert len(expected) == 10
    assert counter[0] == out.frames_decoded
    assert out.frames_decoded <= len(expected) * 15 < 300


# ----------------------------------------------------------------------------- input forms


def test_input_forms_give_identical_frames():
    data = CLIP90.read_bytes()
    ref = load_video(str(CLIP90), fps=1)
    forms = [CLIP90, f"file://{CLIP90}", "data:video/mp4;base64," + base64.b64encode(data).decode(), data,
             bytearray(data), memoryview(data)]
    for form in forms:
        out = load_video(form, fps=1)
        assert np.array_equal(out.frames, ref.frames)
        assert out.frame_indices == ref.frame_indices == [0, 30, 59, 89]
        assert (out.fps, out.total_frames, out.duration_s, out.sample_fps) == (30.0, 90, 3.0, ref.sample_fps)
    assert load_video(data, fps=1).source == "bytes"
    t = ref.tensor()
    assert t.dtype == torch.uint8 and tuple(t.shape) == (4, 240, 320, 3)


def test_http_needs_a_fetch_callable():
    url = "https://example.invalid/clip.mp4"
    with pytest.raises(VideoInputError, match=r"http\(s\) videos are not fetched.*fetch="):
        load_video(url)
    seen = []
    out = load_video(url, nframes=2, fetch=lambda u: seen.append(u) or CLIP90.read_bytes())
    assert seen == [url] and shown(out.frames) == [0, 89] and out.source == url

    def failing(u):
        raise TimeoutError("deadline 10 s")

    with pytest.raises(VideoInputError, match="fetch failed.*deadline 10 s") as err:
        load_video(url, fetch=failing)
    assert err.value.source == url
    with pytest.raises(VideoInputError, match="fetch returned str"):
        load_video(url, fetch=lambda u: "not bytes")


@pytest.mark.parametrize("source, match", [
    ("data:image/png;base64,AAAA", "data URI must be 'data:video/"),
    ("data:video/mp4;base64,@@@", "invalid base64"),
    ("data:video/mp4;base64,", "empty data"),
    (b"", "empty data"),
    (12, "unsupported video source type"),
])
def test_bad_sources_are_named(source, match):
    with pytest.raises(VideoInputError, match=match):
        load_video(source)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(VideoInputError, match="file not found") as err:
        load_video(tmp_path / "nope.mp4")
    assert err.value.source == str(tmp_path / "nope.mp4")
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(VideoInputError, match=r"empty file \(0 bytes\)"):
        probe_video(tmp_path / "empty.mp4")


# ----------------------------------------------------------------------------- bad files


def test_not_a_video():
    path = VIDEOS / "not_a_video.mp4"
    with pytest.raises(VideoInputError, match="not a readable video") as err:
        load_video(path)
    assert err.value.source == str(path)
    assert str(err.value).startswith(f"video input {path}: ")
    assert isinstance(err.value, ValueError)


def test_truncated_files(tmp_path):
    cut_mp4 = CLIP90.read_bytes()[:5000]  # moov at the end: the index is gone
    cut_webm = (VIDEOS / "tall_vp9_10fps_20.webm").read_bytes()[:900]
    faststart = write_clip(tmp_path / "fs.mp4", 60, faststart=True).read_bytes()
    assert faststart.find(b"moov") < faststart.find(b"mdat")
    for data, match in [(cut_mp4, "truncated"),
                        (cut_webm, r"truncated or corrupt: the stream declares 2.000 s, its \d+ readable frames"),
                        (faststart[: int(len(faststart) * 0.8)], r"truncated or corrupt: the container declares 60 "
                                                                  r"frames, \d+ are readable")]:
        path = tmp_path / "cut.bin"
        path.write_bytes(data)
        with pytest.raises(VideoInputError, match=match) as err:
            load_video(path)
        assert err.value.source == str(path)
    assert load_video(faststart, nframes=2).frame_indices == [0, 59]  # the uncut file is fine


def test_zero_frames_and_no_video_stream(tmp_path):
    empty = tmp_path / "noframes.mkv"  # a header, a video track, no frame
    with av.open(str(empty), "w") as out:
        stream = out.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
    with pytest.raises(VideoInputError, match="not a readable video") as err:
        load_video(empty)
    assert err.value.source == str(empty)
    head = (VIDEOS / "tall_vp9_10fps_20.webm").read_bytes()[:433]  # the header, no whole frame
    with pytest.raises(VideoInputError, match="the stream declares 2.000 s but holds no readable frame"):
        load_video(head)
    with pytest.raises(VideoInputError, match=r"zero frames \(total_frames=0\)"):
        sample_frame_indices(0, 30.0)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(b"\0\0" * 800)
    with pytest.raises(VideoInputError, match="no video stream") as err:
        load_video(buf.getvalue())
    assert err.value.source == "bytes"


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("opts, match", [
    ({"fps": 0}, r"option fps=0 must be > 0"),
    ({"fps": -2}, r"option fps=-2 must be > 0"),
    ({"fps": math.nan}, r"option fps=nan must be a finite number"),
    ({"fps": math.inf}, r"option fps=inf must be a finite number"),
    ({"fps": "2"}, r"option fps='2' must be a finite number"),
    ({"fps": True}, r"option fps=True must be a finite number"),
    ({"nframes": 0}, r"option nframes=0 must be >= 1"),
    ({"nframes": -4}, r"option nframes=-4 must be >= 1"),
    ({"fps": 2, "nframes": 4}, r"options fps=2 and nframes=4 are exclusive"),
    ({"nframes": 100}, r"option nframes=100 \(rounded to 100\) exceeds the clip's 90 frames"),
    ({"nframes": 8, "min_frames": 4}, r"min_frames / max_frames apply to fps sampling"),
    ({"min_frames": 0}, r"option min_frames=0 must be >= 1"),
    ({"max_frames": 1}, r"option max_frames=1 must be >= 2"),
    ({"min_frames": 10, "max_frames": 4}, r"option min_frames=10 exceeds max_frames=4"),
    ({"video_start": 2.0, "video_end": 1.0}, r"video_start=2.0 s must be < video_end=1.0 s"),
    ({"video_start": 1.0, "video_end": 1.0}, r"video_start=1.0 s must be < video_end=1.0 s"),
    ({"video_start": -1}, r"option video_start=-1 must be >= 0"),
    ({"video_end": math.inf}, r"option video_end=inf must be a finite number"),
    ({"video_start": 5.0}, r"video_start=5.0 / video_end=None select no range"),  # past the 3 s clip
    ({"video_start": 1.0, "video_end": 1.02}, r"select no range"),               # frames 30 .. 30
    ({"sample_fps": 2.0}, r"sample_fps=2.0 applies to a list of frames"),
])
def test_absurd_options_are_named(opts, match):
    with pytest.raises(VideoInputError, match=match) as err:
        load_video(CLIP90, **opts)
    assert err.value.source == str(CLIP90)


def test_options_checked_before_any_decoding(monkeypatch):
    counter = _count_decoded(monkeypatch)
    with pytest.raises(VideoInputError, match="fps=0"):
        load_video(CLIP90, fps=0)
    assert counter[0] == 0


# ----------------------------------------------------------------------------- frame lists


def test_list_of_pil_frames_with_sample_fps():
    pil = [Image.fromarray(index_frame(i, 56, 56)) for i in range(5)]
    out = load_video(pil, sample_fps=1.0)
    assert out.frames.shape == (6, 56, 56, 3)           # 5 -> 6: the last frame repeated
    assert shown(out.frames) == [0, 1, 2, 3, 4, 4]
    assert out.frame_indices == [0, 1, 2, 3, 4, 5]      # qwen-vl-utils' indices for a frame list
    assert (out.sample_fps, out.fps, out.total_frames, out.duration_s) == (1.0, 1.0, 5, 5.0)
    assert out.frames_decoded == 0 and out.probe.codec is None
    # qwen-vl-utils' own fetch_video on the same list: frames, metadata and sample_fps
    (video, meta), sample_fps = qvu.fetch_video({"video": pil, "sample_fps": 1.0}, return_video_sample_fps=True,
                                                return_video_metadata=True)
    assert video.shape[0] == out.num_frames and sample_fps == out.sample_fps
    assert out.qwen_metadata() == meta
    # and its resize of every frame: video_resized_size on the same frames
    assert tuple(video.shape[2:]) == video_resized_size(56, 56, out.num_frames) == (336, 336)
    default = load_video(pil[:4])
    assert default.sample_fps == 2.0 and shown(default.frames) == [0, 1, 2, 3]


def test_list_of_paths_and_uris_equals_pil(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}.png"
        Image.fromarray(index_frame(i)).save(p)
        paths.append(p)
    forms = [str(paths[0]), f"file://{paths[1]}",
             "data:image/png;base64," + base64.b64encode(paths[2].read_bytes()).decode()]
    out = load_video(forms, sample_fps=3)
    ref = load_video([Image.open(p) for p in paths], sample_fps=3)
    assert np.array_equal(out.frames, ref.frames) and shown(out.frames) == [0, 1, 2, 2]
    assert out.sample_fps == 3.0


def test_bad_frame_lists(tmp_path):
    with pytest.raises(VideoInputError, match="zero frames: the frame list is empty"):
        load_video([])
    small, big = Image.new("RGB", (64, 48)), Image.new("RGB", (32, 48))
    with pytest.raises(VideoInputError, match=r"frames\[1\].*frame size 32x48 differs from frames\[0\]'s 64x48"):
        load_video([small, big])
    with pytest.raises(VideoInputError, match=r"frames\[1\] \(.*nope.png\).*file not found"):
        load_video([small, str(tmp_path / "nope.png")])
    with pytest.raises(VideoInputError, match=r"option fps=2 does not apply to a list of frames"):
        load_video([small], fps=2)
    with pytest.raises(VideoInputError, match=r"option sample_fps=0 must be > 0"):
        load_video([small], sample_fps=0)


# ----------------------------------------------------------------------------- pixel bounds


def test_video_frame_bounds_follow_fetch_video():
    px = 28 * 28
    b = video_frame_bounds(4)  # defaults: 128 .. 768 tokens a frame; total 128000 * 0.9 tokens
    assert (b.min_pixels, b.max_pixels, b.factor) == (128 * px, 768 * px, 28)
    assert video_frame_bounds(8, total_pixels=1_000_000).max_pixels == 250_000           # total / 8 * 2
    assert video_frame_bounds(8, total_pixels=300_000).max_pixels == int(128 * px * 1.05)  # floor: min * 1.05
    assert video_frame_bounds(4, max_pixels=200_000).max_pixels == 200_000               # lowered
    assert video_frame_bounds(4, max_pixels=10**9).max_pixels == 768 * px                # never raised
    assert video_frame_bounds(4, min_pixels=4 * px).min_pixels == 4 * px
    q3 = video_frame_bounds(4, patch_size=16)  # Qwen3-VL
    assert (q3.min_pixels, q3.max_pixels, q3.factor) == (128 * 1024, 768 * 1024, 32)
    # the resized frame: mm_token_pipeline.smart_resize, equal to qwen-vl-utils' own
    assert video_resized_size(240, 320, 4) == qvu.smart_resize(240, 320, 28, 128 * px, 768 * px) == (280, 392)
    assert video_resized_size(240, 320, 8, total_pixels=1_000_000) == qvu.smart_resize(
        240, 320, 28, 128 * px, 250_000) == (280, 392)
    assert video_resized_size(480, 640, 4, max_pixels=256 * px) == qvu.smart_resize(
        480, 640, 28, 128 * px, 256 * px) == (364, 504)
    # Where the two differ: qwen-vl-utils' min_pixels branch overshoots max_pixels (560 x 196 =
    # 109760 > 105369); mm_token_pipeline.smart_resize floors the long side back under it.
    hi = int(128 * px * 1.05)
    assert video_frame_bounds(64, total_pixels=64 * 64 * px).max_pixels == hi
    assert qvu.smart_resize(360, 120, 28, 128 * px, hi) == (560, 196)
    assert video_resized_size(360, 120, 64, total_pixels=64 * 64 * px) == (532, 196)


@pytest.mark.parametrize("kwargs, match", [
    ({"nframes": 0}, r"nframes=0 must be an int >= 1"),
    ({"nframes": 4, "min_pixels": -1}, r"option min_pixels=-1 must be > 0"),
    ({"nframes": 4, "total_pixels": math.nan}, r"option total_pixels=nan must be a finite number"),
    ({"nframes": 4, "min_pixels": 200_000, "max_pixels": 100_000},
     r"option max_pixels=100000 is below min_pixels=200000: no frame size fits"),
])
def test_video_frame_bounds_errors(kwargs, match):
    with pytest.raises(VideoInputError, match=match):
        video_frame_bounds(**kwargs)


def test_a_lone_max_pixels_under_the_default_minimum_lowers_it():
    px = 28 * 28
    bounds = video_frame_bounds(6, max_pixels=64 * px)  # the default minimum is 128 tokens a frame
    assert (bounds.min_pixels, bounds.max_pixels) == (64 * px, 64 * px)
    h, w = video_resized_size(240, 320, 6, max_pixels=64 * px)
    assert h * w <= 64 * px and h % 28 == 0 and w % 28 == 0
