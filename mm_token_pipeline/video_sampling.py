"""Video frame sampling as qwen-vl-utils 0.0.14 does it, and the per-frame pixel bounds of its
``fetch_video``: pure functions of a clip's frame count, fps and the options (no decoding:
``video_io`` reads the clips). Also ``VideoInputError``, raised for every bad video input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import numpy as np
import torch
from qwen_vl_utils import vision_process as _qvu

from .image_io import ImageInputError
from .resize import smart_resize

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
    ``min_pixels`` defaults to ``VIDEO_MIN_TOKEN_NUM * factor**2`` (128 tokens), or to a given
    ``max_pixels`` below that (qwen-vl-utils would resize such a frame above its
    ``max_pixels``; here the bound the caller set holds);
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
    if min_pixels is None and max_pixels is not None and max_pixels < lo:
        lo = max_pixels  # a given max_pixels under the default minimum lowers it (the bound the user set wins)
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
