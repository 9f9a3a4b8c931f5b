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

Layout: this module holds the sources and the two entry points; ``video_sampling`` the pure
sampling rule, the pixel bounds and ``VideoInputError``; ``video_decode`` the PyAV index,
probe and seeking decode. Every public name is importable from here.

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
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from qwen_vl_utils import vision_process as _qvu

from .image_io import ImageInputError, load_image
from .video_decode import VideoProbe, build_frame_index, open_container, probe_stream
from .video_decode import decode_frames as _decode_frames  # the name tests replace
from .video_sampling import (DEFAULT_SAMPLE_FPS, FPS, FPS_MAX_FRAMES, FPS_MIN_FRAMES, FRAME_FACTOR,
                             VIDEO_MAX_TOKEN_NUM, VIDEO_MIN_TOKEN_NUM, SampledFrames, VideoFrameBounds,
                             VideoInputError, _check_options, _check_real, sample_frame_indices,
                             video_frame_bounds, video_resized_size)

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


def read_video_source(source, fetch: Callable[[str], bytes] | None):
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
    name, payload = read_video_source(source, fetch)
    container = open_container(name, payload)
    try:
        stream = container.streams.video[0]
        return probe_stream(name, container, stream, build_frame_index(name, container, stream))
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
    before_decode: Callable[[VideoProbe, SampledFrames], None] | None = None,
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
        before_decode: ``callable(probe, sampling)``, called for a file once its frames are
            sampled and before any is decoded, so the caller may refuse the video there (its
            token count, say) without a second demux pass; not called for a frame list.

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
    name, payload = read_video_source(source, fetch)
    if sample_fps is not None:
        raise VideoInputError(name, f"option sample_fps={sample_fps!r} applies to a list of frames; for a video "
                                    "file give fps or nframes")
    _check_options(name, fps, nframes, min_frames, max_frames, video_start, video_end)  # before any I/O
    container = open_container(name, payload)
    try:
        stream = container.streams.video[0]
        index = build_frame_index(name, container, stream)
        probe = probe_stream(name, container, stream, index)
        sampling = sample_frame_indices(probe.total_frames, probe.fps, source=name, **options)
        if before_decode is not None:
            before_decode(probe, sampling)
        wanted = sorted(set(sampling.indices))
        slots: dict[int, list[int]] = {}
        for k, i in enumerate(sampling.indices):
            slots.setdefault(i, []).append(k)
        out: list[np.ndarray] = []  # the [T, H, W, 3] output, allocated at the first frame

        def keep(i: int, rgb: np.ndarray) -> None:
            # each frame goes straight into the output, so the kept frames are held once (a
            # dict of frames then np.stack held them twice at the peak: glibc keeps the freed
            # frame buffers in its heap)
            if not out:
                out.append(np.empty((len(sampling.indices), *rgb.shape), dtype=np.uint8))
            elif rgb.shape != out[0].shape[1:]:
                raise VideoInputError(name, f"frame size changes within the stream "
                                            f"({sorted({out[0].shape[1:], rgb.shape})}): not supported")
            for k in slots[i]:
                out[0][k] = rgb

        _, count = _decode_frames(name, container, stream, index, wanted, keep=keep)
    finally:
        container.close()
    frames = out[0]
    return VideoFrames(frames=frames, probe=probe, sampling=sampling, frames_decoded=count)
