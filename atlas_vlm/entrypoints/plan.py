"""``atlas-vlm plan``: print a ``memory_plan.plan`` for one model, or the ``--matrix`` of the
four models of the fallback chain (Qwen3-VL-4B, Qwen2.5-VL-3B, SmolVLM2-2.2B,
Qwen2.5-0.5B) and the four dense Qwen3.5 (0.8B, 2B, 4B, 9B; hybrid) over 8-80 GiB GPUs. Configs come from a local folder, a ``.gguf`` file
(the embedded SmolLM2-135M-Instruct without --model, as serve and generate), the bundled
copies of those models' public configs (``atlas_vlm/data/configs``), or the Hub
(config.json only, through huggingface_hub's cache; ``HF_HUB_OFFLINE`` honoured)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from atlas_vlm.config import EngineConfig
from atlas_vlm.default_models import default_text_model
from atlas_vlm.entrypoints.cli import bytes_arg
from atlas_vlm.entrypoints.plan_matrix import CHAIN, HYBRID, MATRIX_GIB, format_matrix, gib
from atlas_vlm.memory_plan import DTYPE_BYTES, IMAGE_SHARE_OF_L, GiB, MemoryPlan, plan

BUNDLED_CONFIGS = Path(__file__).resolve().parent.parent / "data" / "configs"
__all__ = ["BUNDLED_CONFIGS", "CHAIN", "HYBRID", "MATRIX_GIB", "add_parser", "format_plan", "load_config", "plan_model",
           "run"]
DEFAULT_TEXT_NAME = "SmolLM2-135M-Instruct"  # the embedded default model (default_models.default_text_model)


def load_config(model: str, revision: str | None = None):
    """``(transformers config, folder)`` for ``model``: a local folder, a ``.gguf`` file (its
    header, through transformers' GGUF support), the embedded SmolLM2-135M-Instruct GGUF (by
    that name or its Hub id; offline), a bundled chain config (by Hub id or name; with the
    released ``preprocessor_config.json``), or the Hub's ``config.json`` (and
    ``preprocessor_config.json`` where the cache has it).

    Raises:
        atlas_vlm.checkpoint.ModelNotFoundError: none of those has it.
        ValueError: ``model`` is a file other than a ``.gguf``.
    """
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if not path.exists() and model.split("/")[-1] == DEFAULT_TEXT_NAME and revision is None:
        path = Path(default_text_model())  # the embedded GGUF: the same config, no Hub round trip
    if path.is_file() and path.suffix == ".gguf":  # its header holds the config (read offline)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name), path.parent
    if path.is_file():
        raise ValueError(f"{model} is a file; plan reads a config.json or a .gguf: pass a model folder, a .gguf, "
                         "a Hub id (ORG/NAME) or one of the bundled models (see --matrix)")
    if path.is_dir():
        return AutoConfig.from_pretrained(path), path
    bundled = BUNDLED_CONFIGS / model.split("/")[-1]
    if (bundled / "config.json").exists() and revision is None:
        return AutoConfig.from_pretrained(bundled), bundled
    from atlas_vlm.hub import resolve_model_path

    folder = resolve_model_path(model, revision, config_only=True)
    return AutoConfig.from_pretrained(folder), folder


def plan_model(model: str, args, **overrides) -> MemoryPlan:
    """``memory_plan.plan`` of ``model`` with the CLI's options, its image bound from the
    folder's processor settings unless ``--max-pixels`` is given (as the engine). Where that
    checkpoint bound is more visual tokens than L, the plan is made at the largest usable
    image (``MemoryPlan.usable_max_pixels``) and ``note`` says so (no ``--max-pixels`` given)."""
    from atlas_vlm.models.processor_settings import image_processor_settings

    cfg, folder = load_config(model, getattr(args, "revision", None))
    kwargs = dict(model=model, gpu_memory=args.gpu_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                  max_model_len=args.max_model_len, max_pixels=args.max_pixels, dtype=args.dtype,
                  block_size=args.block_size, image_settings=image_processor_settings(folder, cfg),
                  quantization=getattr(args, "quantization", None),
                  video_seconds=getattr(args, "video_seconds", 10.0), video_sampling=_video_sampling(folder),
                  video_fps=getattr(args, "fps", None), video_max_frames=getattr(args, "max_frames", None),
                  video_frames=getattr(args, "frames", None), kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                  max_num_seqs=getattr(args, "max_num_seqs", 64),
                  max_state_snapshots=getattr(args, "max_state_snapshots", 16))
    kwargs.update(overrides)
    p = plan(cfg, **kwargs)
    if p.image_tokens > p.max_model_len and kwargs["max_pixels"] is None and p.usable_max_pixels:
        # the checkpoint's own bound is longer than L: plan the largest image that is usable
        note = (f"note: the checkpoint's max_pixels={p.max_pixels:,} (from {p.pixels_source}) is "
                f"{p.image_tokens:,} visual tokens per image, more than L={p.max_model_len:,}; planned at the "
                f"largest usable image, max_pixels={p.usable_max_pixels:,} ({IMAGE_SHARE_OF_L:.0%} of L at most): "
                f"run the engine with --max-pixels {p.usable_max_pixels} (or raise --max-model-len)")
        p = dataclasses.replace(plan(cfg, **{**kwargs, "max_pixels": p.usable_max_pixels}), note=note,
                                pixels_source="the largest usable image under L (see the note)",
                                bound_image_tokens=p.image_tokens)
    return p


def _video_sampling(folder) -> dict | None:
    """The ``video_sampling`` a SmolVLM2 folder's processor config states (None if none)."""
    import json
    from pathlib import Path

    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = Path(folder) / name
        if path.is_file():
            found = json.loads(path.read_text()).get("video_sampling")
            if found:
                return found
    return None


def _video_row(p: MemoryPlan) -> str:
    if not p.image_tokens:
        return "none (text-only model)"
    if not p.video_tokens:
        return "not stated (the processor config has no video_sampling)"
    fit = f"{p.max_num_video_seqs:,} sequences with one such clip" if p.max_num_video_seqs else \
        f"over L={p.max_model_len:,}: no sequence holds it"
    return (f"{p.video_seconds:g} s clip: {p.video_frames} frames x {p.video_frame_pixels:,} pixels = "
            f"{p.video_tokens:,} visual tokens ({fit})")


def format_plan(p: MemoryPlan) -> str:
    """The plan as aligned ``label  value`` lines."""
    rows = [
        ("model", p.model),
        ("dtype", f"{p.dtype_bytes} bytes per parameter / KV element"),
        ("quantization", p.quantization or "none (dense)"),
        ("weights", f"{gib(p.weight_bytes)} ({p.weight_bytes:,} bytes; vision tower {gib(p.vision_weight_bytes)})"),
        ("image bound", f"max_pixels={p.max_pixels:,} ({p.image_tokens:,} visual tokens per image; "
                        f"{'from ' + p.pixels_source if not p.pixels_source.startswith('max_pixels') else 'given'})"
                        if p.image_tokens else "none (text-only model)"),
        ("video bound", _video_row(p)),
        ("vision activation peak", f"{gib(p.vision_peak_bytes)}" if p.image_tokens else "none"),
        ("KV per token", f"{p.kv_bytes_per_token:,} bytes"
                         + (f" ({p.kv_cache_dtype} K/V + scales)" if p.kv_cache_dtype != "auto" else "")),
        (f"KV per block ({p.block_size} tokens)", f"{p.kv_bytes_per_block:,} bytes"),
        ("GPU memory", f"{gib(p.gpu_memory)} x gpu_memory_utilization {p.gpu_memory_utilization}"),
        ("KV budget", f"{gib(p.kv_budget_bytes)} ({p.kv_budget_bytes:,} bytes)"),
        *([("state slots (hybrid)", f"{p.state_slots} (max_num_seqs) x {p.state_bytes_per_seq:,} bytes = "
            f"{p.state_bytes:,} bytes, off the KV budget first; per sequence, independent of its length")]
          if p.state_slots else []),
        *([("state snapshots (hybrid)", f"{p.state_snapshots} (max_state_snapshots) x {p.state_bytes_per_seq:,} "
            f"bytes = {p.snapshot_bytes:,} bytes, off the KV budget with the slots (prefix caching)")]
          if p.state_snapshots else []),
        ("blocks (num_kvcache_blocks=-1)", f"{p.num_blocks:,} ({p.num_blocks * p.block_size:,} tokens)"),
        (f"sequences of L={p.max_model_len}", f"{p.max_num_seqs:,} at once ({p.blocks_per_seq} blocks each"
                                              + (", one image each" if p.image_tokens else "")
                                              + (f"; at most {p.state_slots} state slots)" if p.state_slots else ")")),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if p.note:
        lines.append(p.note)
    if p.why_not():
        lines.append(p.why_not())
    return "\n".join(lines)


#: The engine settings a plan takes, as the engine's flags (``EngineConfig.add_cli_args``).
PLAN_FIELDS = ("revision", "max_model_len", "dtype", "quantization", "kv_cache_dtype", "block_size",
               "gpu_memory_utilization", "max_state_snapshots", "max_num_seqs", "max_pixels")
#: Where the plan's flag differs from the engine's: a GPU's dtype by default, the schemes memory_plan knows.
PLAN_OVERRIDES = {
    "dtype": {"default": "bfloat16", "choices": tuple(DTYPE_BYTES),
              "help": "Here: the bytes per weight and KV element planned (auto: bf16 on a GPU); bf16 / fp16 / fp32 "
                      "are aliases."},
    "quantization": {"choices": ("int8", "int4", "awq", "gptq"),
                     "help": "Here: the scheme of the decoder's projections planned (default: dense); --matrix adds "
                             "int4 rows when not given."},
    "kv_cache_dtype": {"help": "Here: 1 byte + a 2-byte scale per token and KV head; --matrix adds 'kv int8' rows "
                               "when not given."},
    "max_num_seqs": {"help": "Here: a hybrid model's (Qwen3.5) state slots, one per running sequence."},
}


def add_parser(subparsers) -> None:
    """Register the ``plan`` subcommand."""
    p = subparsers.add_parser("plan", help="KV memory plan of a model from its config.json (no weights)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder, .gguf file, Hub id ORG/NAME, or a bundled model's name (Qwen3-VL-4B-Instruct, "
                                    "Qwen2.5-VL-3B-Instruct, SmolVLM2-2.2B-Instruct, Qwen2.5-0.5B-Instruct, "
                                    "Qwen3.5-0.8B / 2B / 4B / 9B); default: the "
                                    "embedded SmolLM2-135M-Instruct, as serve and generate")
    p.add_argument("--gpu-memory", type=bytes_arg(bare_unit=GiB), default=24 * GiB, help="device memory (default 24GiB)")
    v = p.add_argument_group("the planned video clip")
    v.add_argument("--video-seconds", type=float, default=10.0,
                   help="length of the planned video clip in seconds (default 10): frames x pixels by each "
                        "family's default sampling (qwen-vl-utils fps 2; SmolVLM2's video_sampling)")
    v.add_argument("--fps", type=float, default=None,
                   help="the planned clip's sampling rate, as a video item's fps (default: the family's: "
                        "qwen-vl-utils 2; SmolVLM2's video_sampling)")
    v.add_argument("--max-frames", type=int, default=None, help="at most this many frames (a video item's max_frames)")
    v.add_argument("--frames", type=int, default=None,
                   help="exactly this many frames (a video item's nframes; wins over --fps)")
    EngineConfig.add_cli_args(p, only=PLAN_FIELDS, overrides=PLAN_OVERRIDES)
    p.add_argument("--matrix", action="store_true",
                   help="Qwen3-VL-4B, Qwen2.5-VL-3B, SmolVLM2-2.2B and Qwen2.5-0.5B on 8/12/16/24/48/80 GiB GPUs "
                        "(dense and int4 rows unless --quantization is given), then Qwen3.5-0.8B/2B/4B/9B (dense, "
                        "with their state bytes per sequence)")
    p.set_defaults(func=run)


def run(args) -> int:
    seconds = getattr(args, "video_seconds", 10.0)
    if not seconds > 0:
        raise ValueError(f"--video-seconds must be > 0 (seconds), got {seconds:g}")
    if getattr(args, "max_num_seqs", 64) < 1:
        raise ValueError(f"--max-num-seqs must be >= 1 (sequences), got {args.max_num_seqs}")
    if getattr(args, "max_state_snapshots", 16) < 0:
        raise ValueError(f"--max-state-snapshots must be >= 0, got {args.max_state_snapshots}")
    for flag, value in (("--fps", args.fps), ("--max-frames", args.max_frames), ("--frames", args.frames)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value:g}")
    if args.matrix:
        print(format_matrix(args, lambda model, **overrides: plan_model(model, args, **overrides)))
        return 0
    p = plan_model(args.model or default_text_model(), args)
    print(format_plan(p))
    return 0 if p.fits else 1
