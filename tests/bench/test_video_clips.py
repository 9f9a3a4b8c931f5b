"""The video benchmark's clip maker writes what it is asked: the frame count, the frame rate,
the size, a keyframe every ``gop`` frames, and frames that differ (values only, no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ sits beside tests/
from benchmarks.video import clip_frame, make_clip  # noqa: E402
from mm_token_pipeline import load_video, probe_video  # noqa: E402

pytestmark = pytest.mark.vlm


def test_make_clip_writes_the_frames_asked(tmp_path):
    path = make_clip(tmp_path / "c.mp4", 2.5, width=160, height=120, fps=30, gop=30)
    probe = probe_video(str(path))
    assert probe.total_frames == 75 and probe.fps == 30.0
    assert (probe.width, probe.height) == (160, 120) and probe.codec == "h264"
    assert probe.num_keyframes == 3  # frames 0, 30, 60
    frames = load_video(str(path), nframes=4).frames
    assert frames.shape == (4, 120, 160, 3)
    assert all(np.abs(frames[i].astype(int) - frames[i + 1]).mean() > 5 for i in range(3))


def test_clip_frames_change_every_frame():
    a, b = clip_frame(0, 64, 48), clip_frame(1, 64, 48)
    assert a.shape == (48, 64, 3) and a.dtype == np.uint8
    assert not np.array_equal(a, b)
