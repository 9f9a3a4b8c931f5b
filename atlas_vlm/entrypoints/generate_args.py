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


def add_generation_args(p: argparse.ArgumentParser, *, model_flag: bool = True) -> None:
    """Register the model, engine, sampling and video sampling flags on ``p``.

    ``model_flag=False`` leaves ``--model`` out (``atlas-vlm chat`` takes MODEL positionally).
    """
    p.add_argument("--fps", type=float, default=None, help="video frames sampled per second (default 2, qwen-vl-utils)")
    p.add_argument("--max-frames", type=int, default=None, help="video frames sampled at most")
    if model_flag:
        p.add_argument("--model", default=None,
                       help="HF model folder, .gguf file or Hub id ORG/NAME (default: embedded)")
    p.add_argument("--mmproj", default=None,
                   help="llama.cpp mmproj GGUF (vision tower) of the VLM whose language model GGUF is --model")
    p.add_argument("--revision", default=None, help="Hub branch / tag / commit for a Hub id")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens with probability >= P x the best's; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide / multiply the logits of tokens seen in prompt and output (HF / vLLM); 1 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, per output occurrence, in [-2, 2]")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, once per output token, in [-2, 2]")
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (in [-100, 100]) to a token's logit (OpenAI's logit_bias); repeat for several")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache", choices=["paged", "contiguous"], default="paged")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                   help="K/V storage: auto (the model dtype), int8 or fp8_e4m3 (8 bits + one scale per token and KV "
                        "head: ~1.9x the tokens in the same memory)")
    from atlas_vlm.entrypoints.openai.cli_args import add_kv_cache_dir_args

    add_kv_cache_dir_args(p)
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per request (prompt + output)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="per-image pixel bound after resize: one visual token per 28x28 px on Qwen2.5-VL, "
                        "32x32 on Qwen3-VL / Qwen3.5; SmolVLM2: longest edge floor(sqrt(P)) in whole tiles")
    p.add_argument("--min-pixels", type=int, default=None, help="per-image lower pixel bound after resize")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on CUDA and on CPUs with AMX/AVX512-BF16, else fp32")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf", "gguf_int", "dequantize", "awq", "gptq"],
                   help="weight-only quantization: int8 / int4 at load, gguf as stored (a .gguf's default), "
                        "gguf_int (a .gguf converted to int8 / int4 tiles), dequantize (its dense copy), awq / gptq "
                        "(read from the checkpoint's quantization_config when not given)")
    p.add_argument("--speculative", default=None, choices=["ngram", "mtp"],
                   help="speculative decoding (distribution-exact; token-for-token exact in fp32 or with "
                        "--deterministic): ngram (prompt-lookup drafts) or mtp (a Qwen3.5 checkpoint's "
                        "multi-token-prediction head); docs/speculative.md")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per decode step with --speculative (default 4)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: the same tokens and logprobs whatever the batch (CPU, dense; "
                        "docs/deterministic.md)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM`` keywords from the parsed flags (the model itself not included).

    Raises:
        ValueError: a bad ``--kv-cache-dir`` / ``--kv-cache-dir-max-gb``.
    """
    from atlas_vlm.config import kv_cache_dir_kwargs

    kwargs = dict(kv_cache=args.kv_cache, kvcache_block_size=args.block_size, revision=args.revision,
                  mmproj=args.mmproj, dtype=args.dtype, device=args.device, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, speculative=args.speculative,
                  num_speculative_tokens=args.num_speculative_tokens, deterministic=args.deterministic)
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    for name in ("max_pixels", "min_pixels"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    kwargs.update(kv_cache_dir_kwargs(args.kv_cache_dir, args.kv_cache_dir_max_gb))
    return kwargs


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
