"""The flags ``scripts/generate.py`` and ``atlas-vlm chat`` share (model, engine, sampling, video
sampling), how they become ``LLM`` keywords and ``SamplingParams``, and the input checks both run
before the model loads: an empty prompt, a missing or unreadable image or video, a file given as
``--video`` that is not a video container (an image, a text file).

The checks import only PIL and PyAV (not torch nor the engine), so a bad input fails in well
under a second instead of after the model loaded.
"""

from __future__ import annotations

import argparse
import os

URI_SCHEMES = ("http://", "https://", "data:")  # left to the engine's fetch / decode rules


#: Engine fields that generate / chat do not take as a flag, and why.
NOT_ENGINE_FLAGS = {"seed": "--seed is the request's sampling seed (SamplingParams.seed), which wins over the "
                            "engine's default seed anyway"}


def add_generation_args(p: argparse.ArgumentParser, *, model_flag: bool = True) -> None:
    """Register the video sampling, model, sampling and engine flags on ``p``; the engine flags
    are one per ``EngineConfig`` sub-config field (``EngineConfig.add_cli_args``, as
    ``atlas-vlm serve``'s) less ``NOT_ENGINE_FLAGS``.

    ``model_flag=False`` leaves ``--model`` out (``atlas-vlm chat`` takes MODEL positionally).
    """
    from atlas_vlm.config import EngineConfig

    p.add_argument("--fps", type=float, default=None, help="video frames sampled per second (default 2, qwen-vl-utils)")
    p.add_argument("--max-frames", type=int, default=None, help="video frames sampled at most")
    if model_flag:
        p.add_argument("--model", default=None,
                       help="HF model folder, .gguf file or Hub id ORG/NAME (default: embedded)")
    s = p.add_argument_group("sampling (SamplingParams)")
    s.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0, help="keep tokens with probability >= P x the best's; 0 = off")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide / multiply the logits of tokens seen in prompt and output (HF / vLLM); 1 = off")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, per output occurrence, in [-2, 2]")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, once per output token, in [-2, 2]")
    s.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (in [-100, 100]) to a token's logit (OpenAI's logit_bias); repeat for several")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine's, 0)")
    EngineConfig.add_cli_args(p, exclude=tuple(NOT_ENGINE_FLAGS))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM`` keywords from the parsed engine flags (the model itself not included):
    ``EngineConfig.cli_kwargs``.

    Raises:
        ValueError: a bad ``--kv-cache-dir`` / ``--kv-cache-dir-max-gb``.
    """
    from atlas_vlm.config import EngineConfig

    return EngineConfig.cli_kwargs(args)


def sampling_params(args: argparse.Namespace):
    """The ``SamplingParams`` of the parsed flags. Raises ValueError: an out-of-range value."""
    from atlas_vlm.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                          logit_bias=logit_bias(args.logit_bias) or None, seed=args.seed, max_tokens=args.max_tokens)


def logit_bias(items: list[str]) -> dict[int, float]:
    """``--logit-bias TOKEN_ID=BIAS`` flags as ``SamplingParams.logit_bias``.

    Raises:
        ValueError: an item not of the form ``TOKEN_ID=BIAS`` (an int, then a number), named.
    """
    out = {}
    for item in items:
        tok, sep, bias = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(tok)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias {item!r}: expected TOKEN_ID=BIAS, e.g. 15043=-100") from None
    return out


def video_options(args: argparse.Namespace) -> dict:
    """The video item's sampling keys given on the command line (``fps``, ``max_frames``)."""
    return {k: v for k, v in (("fps", args.fps), ("max_frames", args.max_frames)) if v is not None}


def check_prompt(text: str, flag: str = "--prompt") -> None:
    """Raises ValueError naming ``flag``: ``text`` is empty or only whitespace."""
    if not text or not text.strip():
        raise ValueError(f"{flag} is empty: give the text to send (e.g. {flag} \"What is the capital of France?\")")


def _readable_path(source: str, flag: str) -> str | None:
    """The local path of ``source`` (None for an http(s) / data: URI), after checking it opens and reads.

    Raises:
        ValueError: the path is missing, a folder, or unreadable (the message names it and ``flag``).
    """
    if source.startswith(URI_SCHEMES):
        return None
    path = source[len("file://"):] if source.startswith("file://") else source
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder, not a file")
    try:
        with open(path, "rb") as f:
            head = f.read(1)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc
    if not head:
        raise ValueError(f"{flag} {path}: empty file (0 bytes)")
    return path


def check_image(source: str, flag: str = "--image") -> None:
    """Raises ValueError naming the path: a local image that is missing, unreadable, empty, or a
    file PIL does not recognise as an image (header only; the engine decodes and checks the rest)."""
    path = _readable_path(source, flag)
    if path is None:
        return
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):
            pass
    except UnidentifiedImageError as exc:
        raise ValueError(f"{flag} {path}: not an image (no image format recognised)") from exc
    except Exception:  # a bomb, an odd mode ...: the engine's own image checks report it
        pass


def check_video(source: str, flag: str = "--video") -> None:
    """Raises ValueError naming the path: a local video that is missing, unreadable, empty, or not a
    video container: FFmpeg (PyAV) cannot open it, finds no video stream, or opens it as a still
    image (an image demuxer: PNG, JPEG, ...). Reads the container's header only, decodes nothing."""
    path = _readable_path(source, flag)
    if path is None:
        return
    import av

    try:
        container = av.open(path, mode="r")
    except (av.error.FFmpegError, OSError, EOFError) as exc:
        raise ValueError(f"{flag} {path}: not a video (FFmpeg cannot open it as a video container)") from exc
    with container:
        fmt = container.format.name
        if fmt.endswith("_pipe") or fmt.startswith("image2"):
            raise ValueError(f"{flag} {path}: not a video but a still image (FFmpeg's {fmt} image demuxer "
                             f"reads it); give it with --image")
        if not container.streams.video:
            raise ValueError(f"{flag} {path}: not a video (no video stream in the {fmt} file)")
