"""SmolVLM2 video: frames sampled by SmolVLM's own rule (seeked with our PyAV decoder), and
the prompt ids and per-frame tower items of a chat request holding videos (and images),
all pixel work and prompt text from the HF ``SmolVLMProcessor`` (transformers 5.24).

Sampling. We sample as transformers does for this family: ``SmolVLMProcessor.
apply_chat_template(tokenize=True)`` passes the video processor's ``num_frames`` /
``fps`` (the checkpoint's ``video_sampling.max_frames`` / ``video_sampling.fps``) and
so samples with ``SmolVLMVideoProcessor.sample_frames`` (video_processing_smolvlm.py):
``desired = max(1, min(int(round(fps * duration)), num_frames))``; skip ``skip_secs = 1``
second at both ends when ``duration - 2 > num_frames * fps``; ``np.unique(np.linspace(
start, end, desired, dtype=int))``. We call that very method on the clip's metadata (it is
HF's code, not a copy), then decode only the sampled frames with ``video_decode``
(seeking from the nearest keyframe). The clip's metadata is that of transformers' PyAV
and decord readers (video_utils.py ``read_video_pyav``): ``fps`` = the stream's
``average_rate``, ``total_num_frames`` = frames in the stream (our demux count, which
WebM also has; HF's PyAV reader reads the MP4-only declared count),
``duration = total_num_frames / fps`` seconds.

Prompt. The processor expands each ``<video>`` of the chat text (``SmolVLMProcessor.
replace_video_token``, processing_smolvlm.py) into ``"You are provided the following
series of {num2words(T)} frames from a {H:MM:SS} [H:MM:SS] video.\\n"``, then per frame
``"\\nFrame from {MM:SS}:"`` (``MM = int(t // 60)``, ``SS = int(t % 60)``, ``t = frame
index / fps`` seconds) and one global-view image block ``<fake_token_around_image>
<global-img><image>*image_seq_len<fake_token_around_image>``, then ``"\\n\\n"``;
``H:MM:SS`` is ``timedelta(seconds=int(duration))``. Each frame is resized to
``size["longest_edge"]`` (the checkpoint's ``video_sampling.video_size``), then to a
``max_image_size`` square, rescaled and normalised (``SmolVLMVideoProcessor.resize`` /
``_preprocess``). We pass HF the sampled frames with their metadata and
``do_sample_frames=False``, so HF writes the text and pixels from the same frames.

Several videos in one call: HF pads every video's pixels to the longest one's frame count;
the text (headers, timestamps, image blocks) follows each video's real frames (transformers
>= 5.25; 5.24 wrote the padded count in every header). The ids are HF's own either way
(parity with HF ``generate``). The padded (all-zero) frames get no tower item, as HF's model
drops them.

Tower items. Each frame is one :class:`SmolVLMVideoFrame` (``modality = "video"``): one
``image_seq_len`` run of ``<image>`` tokens, the same token as image tiles, filled in prompt
order by HF's ``inputs_merger``; ``SmolVLMVisionEncoder.encode`` takes them with the
image tiles.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable, ClassVar

import numpy as np
import torch

from mm_token_pipeline.image_io import ImageInputError, load_image
from mm_token_pipeline.video_decode import build_frame_index, decode_frames, open_container, probe_stream
from mm_token_pipeline.video_io import read_video_source
from mm_token_pipeline.video_sampling import VideoInputError

from .tiles import SmolVLMTile, _as_template_messages, global_blocks

__all__ = ["SmolVLMVideo", "SmolVLMVideoFrame", "load_smolvlm_video", "smolvlm_sample_indices", "smolvlm_video_prompt"]


@dataclass(frozen=True, eq=False)
class SmolVLMVideo:
    """One video sampled by SmolVLM's rule (:func:`load_smolvlm_video`).

    Fields:
        source: the name used in errors (path, ``'bytes'``, URI prefix, URL, ``'frames'``).
        frames: uint8 RGB ``[T, H, W, 3]``, the sampled frames in order.
        frame_indices: source frame index of each row of ``frames`` (presentation order).
        fps: source frames per second (a frame list: the ``source_fps`` given).
        total_frames: frames in the source stream (a frame list: frames given).
        duration_s: ``total_frames / fps`` seconds (transformers' PyAV / decord readers).
        num_frames, target_fps, skip_secs: the sampling options used (``None`` for a frame
            list, which is never sampled, as in HF).
        digest: sha256 hex of the frames, their indices, fps and the options.
    """

    source: str
    frames: np.ndarray
    frame_indices: list[int]
    fps: float
    total_frames: int
    duration_s: float
    num_frames: int | None
    target_fps: float | None
    skip_secs: float | None
    digest: str

    @property
    def timestamps_s(self) -> list[float]:
        """Seconds of each sampled frame: ``index / fps`` (HF ``VideoMetadata.timestamps``)."""
        return [i / self.fps for i in self.frame_indices]

    def hf_metadata(self) -> dict:
        """``VideoMetadata`` fields for ``SmolVLMProcessor(..., video_metadata=[...])``."""
        return dict(total_num_frames=self.total_frames, fps=self.fps, duration=self.duration_s,
                    width=int(self.frames.shape[2]), height=int(self.frames.shape[1]), video_backend="pyav",
                    frames_indices=list(self.frame_indices))


@dataclass
class SmolVLMVideoFrame:
    """One sampled frame of a video, as the engine's image item (like :class:`SmolVLMTile`).

    Attributes:
        pixel_values: ``[3, S, S]`` float32 (``S = max_image_size["longest_edge"]``),
            normalised by the HF video processor.
        pixel_attention_mask: ``[S, S]`` bool (all True: frames are resized to the square).
        num_tokens: ``image_seq_len`` ``<image>`` tokens this frame fills.
        content_hash: sha256 hex of the video's :attr:`SmolVLMVideo.digest`, the frame's
            position and source index, and its pixel values (a repeated video hashes equal).
        video_index: which video of the prompt the frame comes from (0-based).
        frame_index: its source frame index; timestamp_s: ``frame_index / fps`` seconds.
        source: the video's name in errors (:attr:`SmolVLMVideo.source`).
    """

    modality: ClassVar[str] = "video"
    pixel_values: torch.Tensor
    pixel_attention_mask: torch.Tensor
    num_tokens: int
    content_hash: str
    video_index: int
    frame_index: int
    timestamp_s: float
    grid_thw: None = None  # no M-RoPE grid: SmolVLM's decoder uses 1-D RoPE
    source: str = ""


def _positive(source: str, name: str, value, *, integral: bool):
    ok = isinstance(value, Integral) if integral else isinstance(value, Real)
    if isinstance(value, bool) or not ok or not np.isfinite(value) or value <= 0:
        kind = "a positive integer" if integral else "a positive number"
        raise VideoInputError(source, f"option {name}={value!r} must be {kind}")
    return int(value) if integral else float(value)


def smolvlm_sample_indices(video_processor, total_frames: int, fps: float | None, *, num_frames=None,
                           target_fps=None, skip_secs: float = 1, source: str = "video") -> list[int]:
    """Frame indices SmolVLM samples from a clip: HF ``SmolVLMVideoProcessor.sample_frames``.

    Args:
        video_processor: the checkpoint's ``SmolVLMVideoProcessor`` (``processor.video_processor``).
        total_frames: frames in the clip; fps: its frames per second (``None``: unknown).
        num_frames: most frames to sample (default ``video_processor.num_frames``, the
            checkpoint's ``video_sampling.max_frames``).
        target_fps: frames to sample per second (default ``video_processor.fps``).
        skip_secs: seconds skipped at both ends of a long clip (HF's default 1).

    Returns:
        sorted unique source frame indices (at least one).

    Raises:
        VideoInputError: unknown fps (timestamps and SmolVLM's rule need it), zero frames,
            no ``num_frames`` / ``target_fps`` given nor in the checkpoint, absurd values.
    """
    if fps is None:
        raise VideoInputError(source, "unknown fps: SmolVLM samples by seconds and writes each frame's timestamp, "
                                      "which need the source frame rate")
    fps = _positive(source, "fps (source)", fps, integral=False)
    if int(total_frames) <= 0:
        raise VideoInputError(source, "zero frames: nothing to sample")
    from transformers.video_utils import VideoMetadata

    num_frames = video_processor.num_frames if num_frames is None else num_frames
    target_fps = video_processor.fps if target_fps is None else target_fps
    for name, value, integral in (("num_frames", num_frames, True), ("fps", target_fps, False)):
        if value is None:
            raise VideoInputError(source, f"no {name} given and the checkpoint's video processor states none "
                                          "(its video_sampling config)")
        _positive(source, name, value, integral=integral)
    if isinstance(skip_secs, bool) or not isinstance(skip_secs, Real) or not np.isfinite(skip_secs) or skip_secs < 0:
        raise VideoInputError(source, f"option skip_secs={skip_secs!r} must be a number >= 0")
    meta = VideoMetadata(total_num_frames=int(total_frames), fps=fps, duration=int(total_frames) / fps)
    indices = video_processor.sample_frames(meta, num_frames=int(num_frames), fps=target_fps, skip_secs=skip_secs)
    return [int(i) for i in indices]


def _digest(frames: np.ndarray, indices: list[int], fps: float, options: tuple) -> str:
    h = hashlib.sha256(b"smolvlm-video|")
    h.update(repr((frames.shape, list(indices), float(fps), options)).encode())
    h.update(np.ascontiguousarray(frames).tobytes())
    return h.hexdigest()


def load_smolvlm_video(source, video_processor, *, num_frames: int | None = None, fps: float | None = None,
                       skip_secs: float = 1, source_fps: float | None = None,
                       fetch: Callable[[str], bytes] | None = None) -> SmolVLMVideo:
    """Decode the frames SmolVLM samples from a video (:func:`smolvlm_sample_indices`), seeking.

    Args:
        source: path, ``file://`` / ``data:video/...;base64,`` URI, bytes, an ``http(s)``
            URL through ``fetch`` (see ``video_io.load_video``), or a list of frames (paths,
            URIs, bytes or ``PIL.Image``, one size): then every frame is taken, unsampled, as
            HF takes frame lists, and ``source_fps`` must say their rate.
        video_processor: the checkpoint's ``SmolVLMVideoProcessor``.
        num_frames, fps, skip_secs: SmolVLM's sampling options (files only).
        source_fps: frames per second of a frame list (its timestamps need it).
        fetch: ``callable(url) -> bytes`` for ``http(s)`` sources; ``None`` refuses them.

    Raises:
        VideoInputError (a ``ValueError`` naming the video): the source's errors (not
            found, not a video, zero frames, truncated, ...), unknown fps, absurd options.
    """
    if isinstance(source, (list, tuple)):
        return _frame_list(source, source_fps, num_frames=num_frames, fps=fps)
    name, payload = read_video_source(source, fetch)
    if source_fps is not None:
        raise VideoInputError(name, f"option source_fps={source_fps!r} applies to a list of frames; a file's "
                                    "rate is read from its stream")
    container = open_container(name, payload)
    try:
        stream = container.streams.video[0]
        index = build_frame_index(name, container, stream)
        probe = probe_stream(name, container, stream, index)
        indices = smolvlm_sample_indices(video_processor, probe.total_frames, probe.fps, num_frames=num_frames,
                                         target_fps=fps, skip_secs=skip_secs, source=name)
        decoded, _ = decode_frames(name, container, stream, index, indices)
    finally:
        container.close()
    if len({decoded[i].shape for i in indices}) != 1:
        raise VideoInputError(name, "frame size changes within the stream: not supported")
    frames = np.stack([decoded[i] for i in indices])
    n = video_processor.num_frames if num_frames is None else num_frames
    f = video_processor.fps if fps is None else fps
    options = (int(n), float(f), float(skip_secs))
    return SmolVLMVideo(source=name, frames=frames, frame_indices=indices, fps=probe.fps,
                        total_frames=probe.total_frames, duration_s=probe.total_frames / probe.fps,
                        num_frames=options[0], target_fps=options[1], skip_secs=options[2],
                        digest=_digest(frames, indices, probe.fps, options))


def _frame_list(items, source_fps, **options) -> SmolVLMVideo:
    given = [k for k, v in options.items() if v is not None]
    if given:
        raise VideoInputError("frames", f"option {given[0]}={options[given[0]]!r} does not apply to a list of "
                                        "frames (every frame is taken, as HF takes frame lists)")
    if len(items) == 0:
        raise VideoInputError("frames", "zero frames: the frame list is empty")
    if source_fps is None:
        raise VideoInputError("frames", "unknown fps: give source_fps for a list of frames (SmolVLM writes each "
                                        "frame's timestamp)")
    source_fps = _positive("frames", "source_fps", source_fps, integral=False)
    arrays = []
    for i, item in enumerate(items):
        try:
            arr = np.asarray(load_image(item), dtype=np.uint8)
        except ImageInputError as exc:
            raise VideoInputError(f"frames[{i}] ({exc.source})", exc.cause) from exc
        if arrays and arr.shape != arrays[0].shape:
            raise VideoInputError(f"frames[{i}]", f"frame size {arr.shape[1]}x{arr.shape[0]} differs from "
                                                  f"frames[0]'s {arrays[0].shape[1]}x{arrays[0].shape[0]} (w x h)")
        arrays.append(arr)
    frames, indices = np.stack(arrays), list(range(len(arrays)))
    return SmolVLMVideo(source="frames", frames=frames, frame_indices=indices, fps=source_fps,
                        total_frames=len(arrays), duration_s=len(arrays) / source_fps, num_frames=None,
                        target_fps=None, skip_secs=None, digest=_digest(frames, indices, source_fps, ()))


def smolvlm_video_prompt(processor, messages: list[dict], images: list, longest_edge: int,
                         videos: list) -> tuple[list[int], list]:
    """Prompt ids and tower items (image tiles and video frames, in prompt order) of a chat
    request holding videos, from one HF ``SmolVLMProcessor`` call.

    Args:
        processor: the checkpoint's ``SmolVLMProcessor``.
        messages: chat messages; image items in the order of ``images``, video items
            (``{"type": "video", "video": ...}``) in the order of ``videos``.
        images: RGB ``PIL.Image`` per image item; longest_edge: their resize target (pixels).
        videos: per video item a :class:`SmolVLMVideo` (:func:`load_smolvlm_video`), or a
            source that is loaded with the checkpoint's sampling defaults.

    Returns:
        ``(ids [N], items)``: item k fills the k-th run of ``image_seq_len`` ``<image>``
        tokens; image tiles are :class:`SmolVLMTile` (``modality = "image"``), frames
        :class:`SmolVLMVideoFrame` (``modality = "video"``).

    Raises:
        ValueError: video / image items and inputs differ in number, or the processor's token
            runs do not match its tiles and frames (e.g. a literal ``<image>`` in user text).
        VideoInputError: a video that cannot be loaded or sampled (names the video).
    """
    videos = [v if isinstance(v, SmolVLMVideo) else load_smolvlm_video(v, processor.video_processor) for v in videos]
    template = _as_template_messages(messages, videos=True)
    n_video_items = sum(1 for m in template for item in m["content"] if item["type"] == "video")
    if n_video_items != len(videos):
        raise ValueError(f"the messages hold {n_video_items} video items but {len(videos)} videos were given")
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    image_kwargs = dict(size={"longest_edge": longest_edge}, input_data_format="channels_last")
    kwargs = dict(images=images, images_kwargs=image_kwargs) if images else {}
    if videos:
        kwargs.update(videos=[v.frames for v in videos],
                      videos_kwargs=dict(video_metadata=[v.hf_metadata() for v in videos], do_sample_frames=False,
                                         input_data_format="channels_last"))
    out = processor(text=text, return_tensors="pt", **kwargs)
    ids = out["input_ids"][0].tolist()
    seq_len = processor.image_seq_len
    # the processor returns one pixel_values key: the videos' when both are given (its merge
    # order), so the images' tiles come from its image processor, called as its __call__ does
    if images and videos:
        img = processor.image_processor([images], return_row_col_info=True, return_tensors="pt", **image_kwargs)
    else:
        img = out
    tile_pixels = img["pixel_values"][0] if images else None  # [num_tiles, 3, tile, tile]
    tile_masks = img["pixel_attention_mask"][0].bool() if images else None  # [num_tiles, tile, tile]
    frame_pixels = out["pixel_values"] if videos else None  # [num_videos, T_max, 3, S, S]
    frame_masks = out["pixel_attention_mask"].bool() if videos else None  # [num_videos, T_max, S, S]

    order = [m.group() for m in re.finditer(f"{re.escape(processor.image_token)}|{re.escape(processor.video_token)}",
                                            text)]  # the placeholders, in prompt order
    blocks = global_blocks(ids, processor)
    items, tile, b = [], 0, 0
    n_image, n_video = 0, 0
    for kind in order:
        if kind == processor.image_token:
            if b >= len(blocks) or tile_pixels is None:
                raise ValueError("the prompt's image blocks do not match its images")
            for _ in range(blocks[b] + 1):
                if tile >= tile_pixels.shape[0]:
                    raise ValueError("the prompt's image blocks hold more tiles than the images give")
                digest = hashlib.sha256(tile_pixels[tile].float().numpy().tobytes())
                digest.update(tile_masks[tile].numpy().tobytes())
                items.append(SmolVLMTile(tile_pixels[tile].float(), tile_masks[tile], seq_len, digest.hexdigest(),
                                         n_image))
                tile += 1
            b, n_image = b + 1, n_image + 1
        else:
            video = videos[n_video]
            for k, (index, t) in enumerate(zip(video.frame_indices, video.timestamps_s)):
                if b >= len(blocks) or blocks[b] != 0:
                    raise ValueError(f"the prompt's image blocks do not match video {n_video}'s "
                                     f"{len(video.frame_indices)} frames")
                pv, mask = frame_pixels[n_video, k].float(), frame_masks[n_video, k]
                digest = hashlib.sha256(f"{video.digest}|{k}|{index}|".encode())
                digest.update(pv.numpy().tobytes())
                digest.update(mask.numpy().tobytes())
                items.append(SmolVLMVideoFrame(pv, mask, seq_len, digest.hexdigest(), n_video, index, t,
                                               source=video.source))
                b += 1
            n_video += 1
    n_image_tokens = sum(1 for t in ids if t == processor.image_token_id)
    if b != len(blocks) or (tile_pixels is not None and tile != tile_pixels.shape[0]) \
            or n_image_tokens != len(items) * seq_len:
        raise ValueError(f"the prompt holds {n_image_tokens} <image> tokens in {len(blocks)} blocks but its images "
                         f"and videos give {len(items)} tiles and frames of {seq_len}; is there a literal image "
                         "token in the text?")
    return ids, items
