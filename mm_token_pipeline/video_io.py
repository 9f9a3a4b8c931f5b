"""Video input: decode with PyAV, probe the stream, sample frames as qwen-vl-utils 0.0.14 does.

Scope (a leaf of the token pipeline; the engine does not call it yet):

- ``load_video`` turns a video source (path, ``file://`` URI, ``data:video/...;base64,`` URI,
  bytes, an ``http(s)://`` URL through a caller-given ``fetch``, or a list of frames: paths /
  URIs / bytes / ``PIL.Image``) into uint8 RGB frames ``[T, H, W, 3]`` plus metadata (source
  fps, total frames, sampled frame indices, ``sample_fps``, duration).
- ``probe_video`` reads the stream's facts without decoding a frame: total frames (one
  demux pass over the packets), source fps (``average_rate``, else the timestamps, else
  stated unknown: never a silent default of 24), duration, width, height, codec.
- ``sample_frame_indices`` is the sampling rule alone (qwen-vl-utils ``smart_nframes`` and
  ``calculate_video_frame_range``, then ``torch.linspace(start, end, nframes).round()``
  as its decord / torchcodec readers do), with clear errors for absurd options.
- ``video_frame_bounds`` / ``video_resized_size``: the per-frame pixel bounds of
  qwen-vl-utils ``fetch_video`` and the resized frame size (``mm_token_pipeline.smart_resize``).

Decoding seeks: the packets are demuxed once (timestamps and keyframe flags only, 8 bytes a
frame; nothing is decoded), then for each wanted frame the decoder starts from the nearest
keyframe at or before it (or simply continues, when no keyframe lies in between) and only the
wanted frames are kept, so memory grows with the frames sampled, not with the file's length.
Frame ``i`` is the ``i``-th frame in presentation order, as decord and torchcodec count.

Not here: the vision-tower input (patchify, ``grid_thw``), the prompt's video tokens,
``second_per_grid_ts`` / timestamps, the HTTP download policy (the engine integration). The
container's rotation metadata is ignored, as qwen-vl-utils' readers ignore it.

Errors: every bad input raises ``VideoInputError`` (a ``ValueError``, built like
``ImageInputError``) whose message names the source and what is wrong: not found, empty,
not a video, no video stream, zero frames, truncated or corrupt data, unknown fps where it
is needed, or an absurd sampling option (named).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import io
import math
import os
from array import array
from dataclasses import dataclass, field
from fractions import Fraction
from numbers import Real
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from qwen_vl_utils import vision_process as _qvu

from .image_io import ImageInputError, load_image
from .resize import smart_resize

__all__ = [
    "VideoInputError",
    "VideoProbe",
    "SampledFrames",
    "VideoFrames",
    "VideoFrameBounds",
    "probe_video",
    "load_video",
    "sample_frame_indices",
    "video_frame_bounds",
    "video_resized_size",
    "FRAME_FACTOR",
    "FPS",
    "FPS_MIN_FRAMES",
    "FPS_MAX_FRAMES",
    "VIDEO_MIN_TOKEN_NUM",
    "VIDEO_MAX_TOKEN_NUM",
    "DEFAULT_SAMPLE_FPS",
]

#: Frames per temporal group; sampled frame counts are multiples of it (qwen-vl-utils).
FRAME_FACTOR: int = _qvu.FRAME_FACTOR
#: Default sampling rate in frames per second of video (qwen-vl-utils ``FPS``).
FPS: float = _qvu.FPS
#: Default lower bound on the frames sampled with ``fps`` (qwen-vl-utils).
FPS_MIN_FRAMES: int = _qvu.FPS_MIN_FRAMES
#: Default upper bound on the frames sampled with ``fps`` (qwen-vl-utils).
FPS_MAX_FRAMES: int = _qvu.FPS_MAX_FRAMES
#: Per-frame token bounds of qwen-vl-utils ``fetch_video`` (times ``factor**2`` pixels).
VIDEO_MIN_TOKEN_NUM: int = _qvu.VIDEO_MIN_TOKEN_NUM
VIDEO_MAX_TOKEN_NUM: int = _qvu.VIDEO_MAX_TOKEN_NUM
#: ``sample_fps`` of a list of frames when none is given (qwen-vl-utils ``fetch_video``).
DEFAULT_SAMPLE_FPS: float = 2.0

_FILE_OPTIONS = ("fps", "nframes", "min_frames", "max_frames", "video_start", "video_end")


class VideoInputError(ValueError):
    """Bad video input or sampling option.

    The message always names the source (a file path, ``'bytes'``, a ``data:`` URI prefix,
    a URL, ``'frames[i]'`` of a frame list) and the cause (file not found, empty, not a
    video, no video stream, zero frames, truncated or corrupt data, unknown fps, an absurd
    option such as ``fps=0`` named with its value, ...).

    Built like ``ImageInputError`` (``source`` and ``cause`` attributes); a ``ValueError``
    so that code written against qwen-vl-utils (which raises ``ValueError``) keeps working.
    """

    def __init__(self, source: str, cause: str) -> None:
        self.source = source
        self.cause = cause
        super().__init__(f"video input {source!s}: {cause}")


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


@dataclass(frozen=True)
class SampledFrames:
    """Which frames qwen-vl-utils' rule takes from a clip (``sample_frame_indices``).

    Fields:
        indices: sampled frame indices (source frames, presentation order), length ``nframes``;
            non-decreasing; a clip shorter than one temporal group repeats its last frame.
        nframes: frames sampled, a multiple of ``FRAME_FACTOR`` (2), at least one group.
        start_frame, end_frame: the sampling window, inclusive (``video_start`` /
            ``video_end`` through ``calculate_video_frame_range``; else ``0 .. total - 1``).
        window_frames: ``end_frame - start_frame + 1``.
        sample_fps: ``nframes / window_frames * video_fps`` as qwen-vl-utils computes it
            (frames per second of the sampled video); ``None`` when the source fps is unknown.
    """

    indices: list[int]
    nframes: int
    start_frame: int
    end_frame: int
    window_frames: int
    sample_fps: float | None


@dataclass(frozen=True, eq=False)
class VideoFrames:
    """Sampled frames of one video and their metadata (``load_video``).

    Fields:
        frames: uint8 RGB ``[T, H, W, 3]`` numpy array (T = ``len(frame_indices)``, a
            multiple of ``FRAME_FACTOR``); :meth:`tensor` gives it as a torch tensor.
        probe: the stream's facts (:class:`VideoProbe`).
        sampling: the sampling rule's result (:class:`SampledFrames`).
        frames_decoded: frames the decoder produced to get these (0 for a frame list); with
            seeking, at most about one keyframe interval per sampled frame, not the file.
    """

    frames: np.ndarray
    probe: VideoProbe
    sampling: SampledFrames
    frames_decoded: int = 0

    @property
    def source(self) -> str:
        """Name of the source used in errors."""
        return self.probe.source

    @property
    def fps(self) -> float | None:
        """Source frames per second (``None``: unknown)."""
        return self.probe.fps

    @property
    def total_frames(self) -> int:
        """Frames in the source stream (or frames given in a list)."""
        return self.probe.total_frames

    @property
    def duration_s(self) -> float | None:
        """Source duration in seconds (``None``: unknown)."""
        return self.probe.duration_s

    @property
    def frame_indices(self) -> list[int]:
        """Sampled frame indices, one per row of ``frames``."""
        return list(self.sampling.indices)

    @property
    def sample_fps(self) -> float | None:
        """Frames per second of the sampled video (qwen-vl-utils' ``sample_fps``)."""
        return self.sampling.sample_fps

    @property
    def num_frames(self) -> int:
        """T, the number of sampled frames."""
        return int(self.frames.shape[0])

    def tensor(self) -> torch.Tensor:
        """The frames as a uint8 torch tensor ``[T, H, W, 3]`` (shares memory with ``frames``)."""
        return torch.from_numpy(self.frames)

    def qwen_metadata(self) -> dict:
        """The ``video_metadata`` dict qwen-vl-utils 0.0.14 ``fetch_video`` returns for this input.

        Keys: ``fps`` (source fps; a frame list's ``sample_fps``), ``frames_indices`` (list of
        int), ``total_num_frames`` (frames in the sampling window, as its decord/torchcodec
        readers set it; for a frame list ``T / sample_fps * fps``), ``video_backend``
        (``'pyav'``; qwen-vl-utils sets no backend key for frame lists, nor do we there).
        """
        if self.probe.codec is None:  # a list of frames
            return dict(fps=self.probe.fps, frames_indices=list(self.sampling.indices),
                        total_num_frames=self.num_frames / self.sampling.sample_fps * self.probe.fps)
        return dict(fps=self.probe.fps, frames_indices=list(self.sampling.indices),
                    total_num_frames=self.sampling.window_frames, video_backend="pyav")


@dataclass(frozen=True)
class VideoFrameBounds:
    """Per-frame pixel bounds of qwen-vl-utils ``fetch_video`` (``video_frame_bounds``).

    Fields:
        min_pixels, max_pixels: bounds on each resized frame's area, in pixels (``max_pixels``
            may be a float, exactly as qwen-vl-utils computes it).
        factor: side granularity in pixels, ``patch_size * merge_size``.
    """

    min_pixels: float
    max_pixels: float
    factor: int


# --------------------------------------------------------------------------- options


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_real(source: str, name: str, value, *, positive: bool, minimum: float | None = None):
    """Return ``float(value)`` or raise VideoInputError naming the option."""
    if not _is_real(value) or not math.isfinite(float(value)):
        raise VideoInputError(source, f"option {name}={value!r} must be a finite number")
    given, value = value, float(value)
    if positive and value <= 0:
        raise VideoInputError(source, f"option {name}={given!r} must be > 0")
    if minimum is not None and value < minimum:
        raise VideoInputError(source, f"option {name}={given!r} must be >= {minimum:g}")
    return value


def _check_options(source: str, fps, nframes, min_frames, max_frames, video_start, video_end) -> dict:
    """Validate the qwen-vl-utils message options; return the given ones as its ``ele`` dict."""
    ele: dict = {}
    if fps is not None and nframes is not None:
        raise VideoInputError(source, f"options fps={fps!r} and nframes={nframes!r} are exclusive: give one "
                                      "(qwen-vl-utils smart_nframes accepts either)")
    if fps is not None:
        ele["fps"] = _check_real(source, "fps", fps, positive=True)
    if nframes is not None:
        ele["nframes"] = _check_real(source, "nframes", nframes, positive=False, minimum=1)
    if min_frames is not None:
        ele["min_frames"] = _check_real(source, "min_frames", min_frames, positive=False, minimum=1)
    if max_frames is not None:
        ele["max_frames"] = _check_real(source, "max_frames", max_frames, positive=False, minimum=FRAME_FACTOR)
    if "min_frames" in ele and "max_frames" in ele and ele["min_frames"] > ele["max_frames"]:
        raise VideoInputError(source, f"option min_frames={min_frames!r} exceeds max_frames={max_frames!r}")
    if nframes is not None and (min_frames is not None or max_frames is not None):
        raise VideoInputError(source, "options min_frames / max_frames apply to fps sampling, not with "
                                      f"nframes={nframes!r}")
    if video_start is not None:
        ele["video_start"] = _check_real(source, "video_start", video_start, positive=False, minimum=0)
    if video_end is not None:
        ele["video_end"] = _check_real(source, "video_end", video_end, positive=False, minimum=0)
    if video_start is not None and video_end is not None and ele["video_start"] >= ele["video_end"]:
        raise VideoInputError(source, f"option video_start={video_start!r} s must be < video_end={video_end!r} s")
    return ele


def sample_frame_indices(
    total_frames: int,
    video_fps: float | None,
    *,
    fps: float | None = None,
    nframes: float | None = None,
    min_frames: float | None = None,
    max_frames: float | None = None,
    video_start: float | None = None,
    video_end: float | None = None,
    source: str = "video",
) -> SampledFrames:
    """Frame indices qwen-vl-utils 0.0.14 samples from a clip of ``total_frames`` frames.

    Rule (its ``_read_video_decord`` / ``_read_video_torchcodec``, whose pure parts are called
    here): the window ``[start_frame, end_frame]`` from ``video_start`` / ``video_end`` in
    seconds (``vision_process.calculate_video_frame_range``: start = ceil(start_s * fps), end =
    floor(end_s * fps), clamped to the clip); ``nframes`` from
    ``vision_process.smart_nframes`` on the window (``nframes`` rounded to a multiple of
    ``FRAME_FACTOR``; or ``window / video_fps * fps`` clamped to ``[min_frames,
    min(max_frames, window)]`` and floored to a multiple of ``FRAME_FACTOR``; defaults fps 2,
    min 4, max 768); indices ``torch.linspace(start, end, nframes).round()``; ``sample_fps =
    nframes / window * video_fps``.

    Where qwen-vl-utils raises and this gives one temporal group instead: a clip of fewer
    than ``FRAME_FACTOR`` frames (1 frame) samples ``FRAME_FACTOR`` frames, its last frame
    repeated (``linspace(0, 0, 2)``); ``nframes=1`` is rounded up to ``FRAME_FACTOR``.

    Args:
        total_frames: frames in the clip (>= 1).
        video_fps: source frames per second; may be ``None`` (unknown) only with ``nframes``
            and no window, or for a clip shorter than one group.
        fps, nframes, min_frames, max_frames, video_start, video_end: qwen-vl-utils' message
            options (frames per second of video, frames, frames, frames, seconds, seconds);
            ``None`` = not given (its defaults apply).
        source: the name used in errors.

    Returns:
        :class:`SampledFrames`.

    Raises:
        VideoInputError: zero frames; fps <= 0 or non-finite; nframes < 1; both fps and
            nframes; min_frames < 1, max_frames < 2, min_frames > max_frames; min/max_frames
            with nframes; a negative or non-finite video_start / video_end, start >= end
            (also when the window holds under two frames, as qwen-vl-utils refuses); nframes
            over the window's frames; an fps-dependent option while the source fps is unknown.
            The message names the option and its value.
    """
    ele = _check_options(source, fps, nframes, min_frames, max_frames, video_start, video_end)
    if isinstance(total_frames, bool) or not isinstance(total_frames, (int, np.integer)) or total_frames < 1:
        raise VideoInputError(source, f"zero frames (total_frames={total_frames!r}): nothing to sample")
    total_frames = int(total_frames)
    if video_fps is not None and (not _is_real(video_fps) or not math.isfinite(video_fps) or video_fps <= 0):
        raise VideoInputError(source, f"source fps {video_fps!r} is not a positive finite number")
    windowed = "video_start" in ele or "video_end" in ele
    if video_fps is None and (windowed or ("nframes" not in ele and total_frames >= FRAME_FACTOR)):
        needs = "video_start / video_end" if windowed else f"fps sampling (fps={ele.get('fps', FPS):g})"
        raise VideoInputError(source, f"source fps unknown (the stream states no frame rate and has too few "
                                      f"timestamps), so {needs} cannot be applied; give nframes instead")
    if windowed:
        try:
            start, end, window = _qvu.calculate_video_frame_range(ele, total_frames, float(video_fps))
        except ValueError as exc:
            raise VideoInputError(
                source, f"options video_start={video_start!r} / video_end={video_end!r} select no range: {exc}"
            ) from exc
    else:
        start, end, window = 0, total_frames - 1, total_frames

    if window < FRAME_FACTOR:  # one frame: one temporal group, the frame repeated
        if "nframes" in ele and _qvu.round_by_factor(ele["nframes"], FRAME_FACTOR) > FRAME_FACTOR:
            raise VideoInputError(source, f"option nframes={nframes!r} exceeds the clip's {window} frame(s)")
        n = FRAME_FACTOR
    elif "nframes" in ele:
        n = max(FRAME_FACTOR, _qvu.round_by_factor(ele["nframes"], FRAME_FACTOR))
        if n > window:
            where = "window" if windowed else "clip"
            raise VideoInputError(source, f"option nframes={nframes!r} (rounded to {n}) exceeds the {where}'s "
                                          f"{window} frames")
        n = _qvu.smart_nframes({"nframes": n}, total_frames=window, video_fps=video_fps or 1.0)
    else:
        try:
            n = _qvu.smart_nframes(ele if "fps" in ele else {**ele, "fps": FPS}, total_frames=window,
                                   video_fps=float(video_fps))
        except ValueError as exc:  # not reachable with the checks above; kept as a named error
            raise VideoInputError(source, f"sampling options {ele} give no frames: {exc}") from exc
    n = int(n)
    indices = torch.linspace(start, end, n).round().long().tolist()
    sample_fps = None if video_fps is None else n / max(window, 1e-6) * float(video_fps)
    return SampledFrames(indices=indices, nframes=n, start_frame=int(start), end_frame=int(end),
                         window_frames=int(window), sample_fps=sample_fps)


# --------------------------------------------------------------------------- pixel bounds


def video_frame_bounds(
    nframes: int,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: float | None = None,
    max_pixels: float | None = None,
    total_pixels: float | None = None,
    source: str = "video",
) -> VideoFrameBounds:
    """Per-frame pixel bounds of a video of ``nframes`` frames, as qwen-vl-utils 0.0.14 ``fetch_video``.

    Rule (``vision_process.fetch_video``): ``factor = patch_size * merge_size``;
    ``min_pixels`` defaults to ``VIDEO_MIN_TOKEN_NUM * factor**2`` (128 tokens);
    ``total_pixels`` to ``MODEL_SEQ_LEN * factor**2 * 0.9`` (``MODEL_SEQ_LEN`` = 128000, or
    the environment's, as qwen-vl-utils reads it at import); per frame ``max_pixels =
    max(min(VIDEO_MAX_TOKEN_NUM * factor**2, total_pixels / nframes * FRAME_FACTOR),
    int(min_pixels * 1.05))``, then lowered to a given ``max_pixels`` (never raised).

    Args:
        nframes: frames of the sampled video, T (after any padding), >= 1.
        patch_size, merge_size: the vision tower's patch side in pixels and spatial merge
            (14 and 2 for Qwen2/2.5-VL, 16 and 2 for Qwen3-VL).
        min_pixels, max_pixels, total_pixels: the item's options in pixels (``None``: default).
        source: the name used in errors.

    Returns:
        :class:`VideoFrameBounds` (min_pixels, max_pixels, factor).

    Raises:
        VideoInputError: nframes < 1, a non-positive or non-finite pixel option, or a given
            ``max_pixels`` below ``min_pixels`` (no size fits; qwen-vl-utils only asserts).
    """
    if isinstance(nframes, bool) or not isinstance(nframes, (int, np.integer)) or nframes < 1:
        raise VideoInputError(source, f"nframes={nframes!r} must be an int >= 1 (frames)")
    for name, value in (("patch_size", patch_size), ("merge_size", merge_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise VideoInputError(source, f"{name}={value!r} must be an int >= 1 (pixels / patches)")
    factor = patch_size * merge_size
    if min_pixels is not None:
        min_pixels = _check_real(source, "min_pixels", min_pixels, positive=True)
    if total_pixels is not None:
        total_pixels = _check_real(source, "total_pixels", total_pixels, positive=True)
    if max_pixels is not None:
        max_pixels = _check_real(source, "max_pixels", max_pixels, positive=True)
    frame_min = VIDEO_MIN_TOKEN_NUM * factor * factor
    frame_max = VIDEO_MAX_TOKEN_NUM * factor * factor
    lo = frame_min if min_pixels is None else min_pixels
    total = _qvu.MODEL_SEQ_LEN * factor * factor * 0.9 if total_pixels is None else total_pixels
    hi = max(min(frame_max, total / int(nframes) * FRAME_FACTOR), int(lo * 1.05))
    if max_pixels is not None:
        hi = min(max_pixels, hi)
    if hi < lo:
        raise VideoInputError(source, f"option max_pixels={max_pixels:g} is below min_pixels={lo:g}: no frame "
                                      "size fits")
    if isinstance(lo, float) and lo.is_integer():
        lo = int(lo)
    if isinstance(hi, float) and hi.is_integer():
        hi = int(hi)
    return VideoFrameBounds(min_pixels=lo, max_pixels=hi, factor=factor)


def video_resized_size(
    height: int,
    width: int,
    nframes: int,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: float | None = None,
    max_pixels: float | None = None,
    total_pixels: float | None = None,
    source: str = "video",
) -> tuple[int, int]:
    """``(resized_height, resized_width)`` in pixels of each frame of a ``height x width`` video.

    The bounds of :func:`video_frame_bounds` (same arguments), then
    ``mm_token_pipeline.smart_resize`` (qwen-vl-utils ``smart_resize``: both sides multiples
    of ``patch_size * merge_size``, area within the bounds, aspect ratio kept) as
    qwen-vl-utils ``fetch_video`` resizes every frame.

    Raises:
        VideoInputError: the bounds' errors, a non-positive size, or an aspect ratio over 200.
    """
    bounds = video_frame_bounds(nframes, patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels,
                                max_pixels=max_pixels, total_pixels=total_pixels, source=source)
    try:
        return smart_resize(height, width, factor=bounds.factor, min_pixels=bounds.min_pixels,
                            max_pixels=bounds.max_pixels, source=source)
    except ImageInputError as exc:
        raise VideoInputError(source, exc.cause) from exc
    except ValueError as exc:
        raise VideoInputError(source, str(exc)) from exc


# --------------------------------------------------------------------------- sources


def _read_source(source, fetch: Callable[[str], bytes] | None):
    """Return ``(name, path_or_bytes)`` for a single video source; raises VideoInputError."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise VideoInputError("bytes", "empty data (0 bytes)")
        return "bytes", data
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise VideoInputError(repr(type(source).__name__), "unsupported video source type (path, file:// or "
                                                            "data: URI, bytes, URL or a list of frames)")
    if source.startswith("data:"):
        name = source[:30] + "..."
        if not source.startswith("data:video/") or ";base64," not in source:
            raise VideoInputError(name, "data URI must be 'data:video/...;base64,...'")
        try:
            data = base64.b64decode(source.split(";base64,", 1)[1], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise VideoInputError(name, f"invalid base64 data ({exc})") from exc
        if not data:
            raise VideoInputError(name, "empty data (0 bytes)")
        return name, data
    if source.startswith(("http://", "https://")):
        if fetch is None:
            raise VideoInputError(source, "http(s) videos are not fetched by load_video: pass fetch=callable(url) "
                                          "-> bytes (the caller's download policy)")
        try:
            data = fetch(source)
        except Exception as exc:  # the caller's fetch: any failure is this source's error
            raise VideoInputError(source, f"fetch failed ({type(exc).__name__}: {exc})") from exc
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise VideoInputError(source, f"fetch returned {type(data).__name__}, expected bytes")
        if not data:
            raise VideoInputError(source, "empty download (0 bytes)")
        return source, bytes(data)
    path = source[len("file://"):] if source.startswith("file://") else source
    if not os.path.isfile(path):
        raise VideoInputError(path, "file not found")
    if os.path.getsize(path) == 0:
        raise VideoInputError(path, "empty file (0 bytes)")
    return path, path


def _av():
    import av  # imported here so that the image-only paths never need it

    return av


@dataclass
class _Index:
    """Presentation-order timestamps of a stream's frames and where its keyframes are."""

    pts: np.ndarray  # [N] int64, sorted
    keyframes: list[int] = field(default_factory=list)  # frame indices, sorted


def _open(name: str, payload):
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


def _build_index(name: str, container, stream) -> _Index:
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
    return _Index(pts=order, keyframes=keys)


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


def _probe(name: str, container, stream, index: _Index) -> VideoProbe:
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


def _decode_frames(name: str, container, stream, index: _Index, wanted: Sequence[int]):
    """Decode the ``wanted`` frame indices (sorted, unique), seeking between keyframes.

    Returns ``({index: uint8 [H, W, 3]}, frames_decoded)``. Before each wanted frame the
    decoder seeks to the nearest keyframe at or before it, unless it is already at or past
    that keyframe (then it continues); only wanted frames are converted and kept.
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
                    out[w] = frame.to_ndarray(format="rgb24")
                    break
                if i > w:  # the seek landed past the wanted frame: decode from the start once
                    if retried:
                        raise VideoInputError(name, f"truncated or corrupt: frame {w} could not be decoded")
                    retried = True
                    start_at(0)
    except av.error.FFmpegError as exc:
        raise VideoInputError(name, f"truncated or corrupt video data while decoding ({exc})") from exc
    return out, decoded


def _frames_from_list(items, sample_fps, options: dict) -> VideoFrames:
    """A list of frames as qwen-vl-utils ``fetch_video`` takes it: every frame, padded to a group."""
    given = [k for k, v in options.items() if v is not None]
    if given:
        raise VideoInputError("frames", f"option {given[0]}={options[given[0]]!r} does not apply to a list of "
                                        "frames (every frame is taken; give sample_fps)")
    sample_fps = DEFAULT_SAMPLE_FPS if sample_fps is None else _check_real("frames", "sample_fps", sample_fps,
                                                                             positive=True)
    if len(items) == 0:
        raise VideoInputError("frames", "zero frames: the frame list is empty")
    arrays = []
    for i, item in enumerate(items):
        try:
            image = load_image(item)
        except ImageInputError as exc:
            raise VideoInputError(f"frames[{i}] ({exc.source})", exc.cause) from exc
        arr = np.asarray(image, dtype=np.uint8)
        if arrays and arr.shape != arrays[0].shape:
            raise VideoInputError(f"frames[{i}]", f"frame size {arr.shape[1]}x{arr.shape[0]} differs from "
                                                  f"frames[0]'s {arrays[0].shape[1]}x{arrays[0].shape[0]} (w x h)")
        arrays.append(arr)
    given_frames = len(arrays)
    n = _qvu.ceil_by_factor(given_frames, FRAME_FACTOR)
    arrays.extend([arrays[-1]] * (n - given_frames))
    frames = np.stack(arrays)
    h, w = frames.shape[1:3]
    probe = VideoProbe(source="frames", total_frames=given_frames, fps=sample_fps, fps_source="sample_fps",
                       duration_s=given_frames / sample_fps, width=int(w), height=int(h), codec=None)
    sampling = SampledFrames(indices=list(range(n)), nframes=n, start_frame=0, end_frame=given_frames - 1,
                             window_frames=given_frames, sample_fps=sample_fps)
    return VideoFrames(frames=frames, probe=probe, sampling=sampling, frames_decoded=0)


# --------------------------------------------------------------------------- public entry points


def probe_video(source, *, fetch: Callable[[str], bytes] | None = None) -> VideoProbe:
    """Facts of a video file's first video stream, without decoding a frame.

    Args:
        source: path, ``file://`` URI, ``data:video/...;base64,...`` URI, bytes, or an
            ``http(s)://`` URL given to ``fetch``.
        fetch: ``callable(url) -> bytes`` for ``http(s)`` sources (the caller's download
            policy and limits); ``None`` refuses them.

    Returns:
        :class:`VideoProbe`: total frames (one demux pass over the packets), source fps
        (stream ``average_rate``; else from the timestamps; else ``None`` with
        ``fps_source='unknown'``), duration in seconds, width and height in pixels, codec.

    Raises:
        VideoInputError: not found, empty, not a video, no video stream, zero frames,
            truncated or corrupt data: fewer readable frames than the container declares
            (MP4), or, where no count is declared (WebM / Matroska), frames that stop more
            than two frames plus 50 ms short of the stated duration.
    """
    name, payload = _read_source(source, fetch)
    container = _open(name, payload)
    try:
        stream = container.streams.video[0]
        return _probe(name, container, stream, _build_index(name, container, stream))
    finally:
        container.close()


def load_video(
    source,
    *,
    fps: float | None = None,
    nframes: float | None = None,
    min_frames: float | None = None,
    max_frames: float | None = None,
    video_start: float | None = None,
    video_end: float | None = None,
    sample_fps: float | None = None,
    fetch: Callable[[str], bytes] | None = None,
) -> VideoFrames:
    """Decode the frames qwen-vl-utils 0.0.14 would sample from a video, seeking to each.

    Args:
        source: path, ``file://`` URI, ``data:video/...;base64,...`` URI, bytes, an
            ``http(s)://`` URL (only through ``fetch``), or a list / tuple of frames (each a
            path, URI, bytes or ``PIL.Image``, loaded by ``load_image``; all one size).
        fps, nframes, min_frames, max_frames, video_start, video_end: qwen-vl-utils' message
            options (see :func:`sample_frame_indices`); for files only.
        sample_fps: frames per second of a frame list (default 2.0, as qwen-vl-utils); for
            frame lists only.
        fetch: ``callable(url) -> bytes`` for ``http(s)`` sources; ``None`` refuses them.

    Returns:
        :class:`VideoFrames`: uint8 RGB ``frames [T, H, W, 3]`` (T a multiple of
        ``FRAME_FACTOR``), the stream's :class:`VideoProbe`, the :class:`SampledFrames`
        (frame indices, ``sample_fps``, window) and the count of frames decoded. A file is
        sampled by :func:`sample_frame_indices`; a frame list keeps every frame, the last
        repeated up to a multiple of ``FRAME_FACTOR``, with indices ``0 .. T-1`` and
        ``sample_fps`` as qwen-vl-utils ``fetch_video`` gives them. Frames are not resized
        here (:func:`video_resized_size` gives the size qwen-vl-utils resizes them to).

    Raises:
        VideoInputError: the source's errors (see :func:`probe_video`), a wanted frame that
            cannot be decoded (truncated), an absurd or inapplicable option (named), an empty
            frame list, frames of different sizes, a frame that is not an image.
    """
    options = dict(fps=fps, nframes=nframes, min_frames=min_frames, max_frames=max_frames,
                   video_start=video_start, video_end=video_end)
    if isinstance(source, (list, tuple)):
        return _frames_from_list(source, sample_fps, options)
    name, payload = _read_source(source, fetch)
    if sample_fps is not None:
        raise VideoInputError(name, f"option sample_fps={sample_fps!r} applies to a list of frames; for a video "
                                    "file give fps or nframes")
    _check_options(name, fps, nframes, min_frames, max_frames, video_start, video_end)  # before any I/O
    container = _open(name, payload)
    try:
        stream = container.streams.video[0]
        index = _build_index(name, container, stream)
        probe = _probe(name, container, stream, index)
        sampling = sample_frame_indices(probe.total_frames, probe.fps, source=name, **options)
        wanted = sorted(set(sampling.indices))
        decoded, count = _decode_frames(name, container, stream, index, wanted)
    finally:
        container.close()
    shapes = {decoded[i].shape for i in wanted}
    if len(shapes) != 1:
        raise VideoInputError(name, f"frame size changes within the stream ({sorted(shapes)}): not supported")
    frames = np.stack([decoded[i] for i in sampling.indices])
    return VideoFrames(frames=frames, probe=probe, sampling=sampling, frames_decoded=count)
