"""PyAV demuxing, probing and seeking decode of one video stream (``video_io`` calls it):
the packet index (timestamps and keyframe flags, one demux pass), the stream's facts, and
the decode of the wanted frames only, each from the nearest keyframe at or before it.
"""

from __future__ import annotations

import bisect
import io
from array import array
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from .video_sampling import VideoInputError


@dataclass(frozen=True)
class VideoProbe:
    """Facts of a video stream, read without decoding a frame.

    Fields:
        source: the name used in errors (path, ``'bytes'``, URI prefix, URL, ``'frames'``).
        total_frames: frames in the stream (video packets counted by one demux pass, not the
            container's declared count, which WebM lacks); for a frame list, the frames given.
        fps: source frames per second, or ``None`` when unknown.
        fps_source: where ``fps`` comes from: ``'average_rate'`` (the stream's),
            ``'timestamps'`` (``(total_frames - 1) / (last_pts - first_pts)`` in seconds,
            when the stream states no rate), ``'sample_fps'`` (a frame list) or ``'unknown'``.
        duration_s: seconds: the stream's stated duration (MP4 ``duration`` x time_base,
            Matroska ``DURATION`` tag), else the container's, else ``total_frames / fps``;
            ``None`` when none is known.
        width, height: frame size in pixels (the stream's; a frame list's first frame).
        codec: FFmpeg decoder name (``'h264'``, ``'vp9'``, ...); ``None`` for a frame list.
        time_base: the stream's time base (seconds per pts unit); ``None`` for a frame list.
        num_keyframes: keyframe packets in the stream (0 for a frame list).
    """

    source: str
    total_frames: int
    fps: float | None
    fps_source: str
    duration_s: float | None
    width: int
    height: int
    codec: str | None
    time_base: Fraction | None = None
    num_keyframes: int = 0


def _av():
    import av  # imported here so that the image-only paths never need it

    return av


@dataclass
class FrameIndex:
    """Presentation-order timestamps of a stream's frames and where its keyframes are."""

    pts: np.ndarray  # [N] int64, sorted
    keyframes: list[int] = field(default_factory=list)  # frame indices, sorted


def open_container(name: str, payload):
    """``av.open`` of a path or bytes (``name`` labels errors); raises ``VideoInputError``."""
    av = _av()
    try:
        container = av.open(io.BytesIO(payload) if isinstance(payload, bytes) else payload, mode="r")
    except av.error.FFmpegError as exc:
        raise VideoInputError(name, f"not a readable video: not a video, or truncated / corrupt (FFmpeg: "
                                    f"{exc.strerror or exc})") from exc
    except (OSError, EOFError) as exc:
        raise VideoInputError(name, f"cannot open video ({exc})") from exc
    if not container.streams.video:
        container.close()
        raise VideoInputError(name, "no video stream in the file")
    return container


def build_frame_index(name: str, container, stream) -> FrameIndex:
    """One demux pass: packet timestamps and keyframe flags, no decoding (8 bytes a frame)."""
    av = _av()
    pts, key_pts = array("q"), array("q")
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the flush packet at the end
                continue
            ts = packet.pts if packet.pts is not None else packet.dts
            if ts is None:
                raise VideoInputError(name, "a video packet has no timestamp: cannot index its frames")
            pts.append(ts)
            if packet.is_keyframe:
                key_pts.append(ts)
    except av.error.FFmpegError as exc:
        raise VideoInputError(name, f"truncated or corrupt video data while reading packets ({exc})") from exc
    order = np.sort(np.frombuffer(pts, dtype=np.int64)) if len(pts) else np.zeros(0, dtype=np.int64)
    if len(order) > 1 and np.any(order[1:] == order[:-1]):
        raise VideoInputError(name, "two video frames share one timestamp: cannot index its frames")
    keys = sorted(int(i) for i in np.searchsorted(order, np.frombuffer(key_pts, dtype=np.int64)))
    if not keys or keys[0] != 0:
        keys.insert(0, 0)  # decoding from the first frame always works
    return FrameIndex(pts=order, keyframes=keys)


def _declared_duration_s(container, stream) -> float | None:
    """The video stream's own stated duration in seconds (``None``: not stated).

    The stream's ``duration`` (MP4), else its Matroska ``DURATION`` tag (``HH:MM:SS.nnn``),
    else the container's duration when the file holds no other stream (so an audio track
    that outlasts the video is never taken for the video's length).
    """
    tb = stream.time_base
    if stream.duration is not None and tb is not None and stream.duration > 0:
        return float(stream.duration * tb)
    tag = (stream.metadata or {}).get("DURATION")
    if tag:
        try:
            h, m, sec = tag.split(":")
            return int(h) * 3600 + int(m) * 60 + float(sec)
        except ValueError:
            pass
    if len(container.streams) == 1 and container.duration is not None and container.duration > 0:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def probe_stream(name: str, container, stream, index: FrameIndex) -> VideoProbe:
    """The stream's frame count, fps and duration (``VideoProbe``) from its index."""
    total = int(len(index.pts))
    declared_s = _declared_duration_s(container, stream)
    if total == 0:
        if declared_s:
            raise VideoInputError(name, f"truncated or corrupt: the stream declares {declared_s:.3f} s but holds "
                                        "no readable frame")
        raise VideoInputError(name, "zero frames: the video stream holds no frames")
    declared = int(stream.frames or 0)  # MP4 states its frame count; Matroska / WebM do not
    if declared and total < declared:
        raise VideoInputError(name, f"truncated or corrupt: the container declares {declared} frames, "
                                    f"{total} are readable")
    tb = stream.time_base
    rate = stream.average_rate
    if rate is not None and rate > 0:
        fps, fps_source = float(rate), "average_rate"
    elif tb is not None and total > 1 and index.pts[-1] > index.pts[0]:
        fps, fps_source = (total - 1) / float((int(index.pts[-1]) - int(index.pts[0])) * tb), "timestamps"
    else:
        fps, fps_source = None, "unknown"
    if not declared and fps is not None and declared_s is not None and tb is not None:
        # No frame count to check against: the frames must cover the stated duration (to
        # within two frames and 50 ms; a variable-rate stream whose last frame lasts longer
        # than that would be refused here).
        covered_s = float((int(index.pts[-1]) - int(index.pts[0])) * tb) + 1.0 / fps
        if declared_s - covered_s > 2.0 / fps + 0.05:
            raise VideoInputError(name, f"truncated or corrupt: the stream declares {declared_s:.3f} s, its "
                                        f"{total} readable frames cover {covered_s:.3f} s")
    if declared_s is not None:
        duration = declared_s
    elif container.duration is not None and container.duration > 0:
        duration = container.duration / 1_000_000  # AV_TIME_BASE
    elif fps is not None:
        duration = total / fps
    else:
        duration = None
    ctx = stream.codec_context
    return VideoProbe(source=name, total_frames=total, fps=fps, fps_source=fps_source, duration_s=duration,
                      width=int(stream.width or ctx.width), height=int(stream.height or ctx.height),
                      codec=ctx.name, time_base=tb, num_keyframes=len(index.keyframes))


def _decode_packet(packet):
    """Decode one packet into its frames (one seam, so tests can count decoded frames)."""
    return packet.decode()


def decode_frames(name: str, container, stream, index: FrameIndex, wanted: Sequence[int],
                   keep: Callable[[int, np.ndarray], None] | None = None):
    """Decode the ``wanted`` frame indices (sorted, unique), seeking between keyframes.

    Returns ``({index: uint8 [H, W, 3]}, frames_decoded)``. Before each wanted frame the
    decoder seeks to the nearest keyframe at or before it, unless it is already at or past
    that keyframe (then it continues); only wanted frames are converted and kept. With
    ``keep``, each wanted frame goes to ``keep(index, rgb)`` as soon as it is decoded instead
    (the dict comes back empty), so a caller can copy it into its output and drop it.
    """
    av = _av()
    out: dict[int, np.ndarray] = {}
    decoded = 0
    pos = None  # index of the last frame the running decoder produced; None: no decoder running
    frames_iter = None

    def run():
        for packet in container.demux(stream):
            for frame in _decode_packet(packet):
                yield frame

    def start_at(key: int):
        nonlocal frames_iter, pos
        container.seek(int(index.pts[key]), stream=stream, backward=True, any_frame=False)
        frames_iter, pos = run(), key - 1

    try:
        for w in wanted:
            key = index.keyframes[bisect.bisect_right(index.keyframes, w) - 1]
            if frames_iter is None or pos is None or pos >= w or key > pos:
                start_at(key)
            retried = False
            while True:
                frame = next(frames_iter, None)
                if frame is None:
                    raise VideoInputError(name, f"truncated or corrupt: frame {w} could not be decoded "
                                                f"(the stream ended after {decoded} decoded frames)")
                decoded += 1
                ts = frame.pts
                i = int(np.searchsorted(index.pts, ts)) if ts is not None else -1
                if ts is None or i >= len(index.pts) or index.pts[i] != ts:
                    continue  # a frame the index does not know (no timestamp): not one we want
                pos = i
                if i == w:
                    rgb = frame.to_ndarray(format="rgb24")
                    if keep is None:
                        out[w] = rgb
                    else:
                        keep(w, rgb)
                    break
                if i > w:  # the seek landed past the wanted frame: decode from the start once
                    if retried:
                        raise VideoInputError(name, f"truncated or corrupt: frame {w} could not be decoded")
                    retried = True
                    start_at(0)
    except av.error.FFmpegError as exc:
        raise VideoInputError(name, f"truncated or corrupt video data while decoding ({exc})") from exc
    return out, decoded
