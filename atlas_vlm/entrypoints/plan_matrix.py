"""``atlas-vlm plan --matrix``: the fallback chain's four models (dense, int4, and both with an
8-bit KV cache) and the four dense Qwen3.5 (hybrid: KV for the full-attention layers only, plus
a state slot per running sequence) over 8-80 GiB GPUs, from their bundled configs."""

from __future__ import annotations

from typing import Callable

from atlas_vlm.memory_plan import IMAGE_SHARE_OF_L, GiB, MemoryPlan

CHAIN = ("Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct", "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
         "Qwen/Qwen2.5-0.5B-Instruct")  # the brief's fallback chain, largest first
MATRIX_GIB = (8, 12, 16, 24, 48, 80)
HYBRID = ("Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-9B")  # bundled, --matrix too

PlanOne = Callable[..., MemoryPlan]  # plan.plan_model with the CLI's args bound: (model, **overrides)


def gib(n: int) -> str:
    """``n`` bytes as ``"1.23 GiB"``."""
    return f"{n / GiB:.2f} GiB"


def _image_tokens(p: MemoryPlan) -> str:
    """The matrix's ``image tok``: the checkpoint's (or --max-pixels') image, before any re-plan."""
    if not p.image_tokens:
        return "-"
    return str(p.bound_image_tokens or p.image_tokens)


def _row(plan_one: PlanOne, model: str, args, length: int, quant: str | None, kv: str, state: bool = False) -> str:
    """One matrix line: name, weights, KV bytes per token, image tokens, then per GPU size
    ``sequences (blocks)``, usable pixels, video tokens (``state``: and the state bytes per
    sequence of a hybrid model)."""
    cells, first = [], None
    for g in MATRIX_GIB:
        p = plan_one(model, gpu_memory=g * GiB, max_model_len=length, quantization=quant, kv_cache_dtype=kv)
        first = first or p
        seqs = "-" if not p.num_blocks else "img>L" if p.image_tokens > length else \
            f"{p.max_num_seqs}*" if p.note else f"{p.max_num_seqs}"
        cells.append(f"{seqs:>5} {f'({p.num_blocks})':>8}")
    name = " ".join([model, *([quant] if quant else []), *([f"kv {kv}"] if kv != "auto" else [])])
    usable = f"{first.usable_max_pixels:,}" if first.note or first.image_tokens > length else "-"
    line = (f"{name:<50} {gib(first.weight_bytes):>10} {first.kv_bytes_per_token:>9,} "
            f"{_image_tokens(first):>9} " + " ".join(cells) + f" {usable:>10} {first.video_tokens or '-':>9}")
    return line + (f" {first.state_bytes_per_seq:>12,}" if state else "")


def format_matrix(args, plan_one: PlanOne) -> str:
    """One row per model of the fallback chain (dense and int4 unless ``--quantization`` is
    given; each again with an int8 KV cache unless ``--kv-cache-dtype`` is given), then one per
    dense Qwen3.5 (with a ``state/seq`` column: recurrent + conv state bytes per sequence, the
    same at any length); per GPU size ``sequences (blocks)`` for sequences of
    ``max_model_len`` tokens with one image each. Qwen3.5's sequences are at most
    ``--max-num-seqs`` (one state slot each, taken off the KV budget first). ``plan_one``:
    ``(model, **overrides) -> MemoryPlan``, the CLI's ``plan_model`` with its args bound."""
    length = args.max_model_len or 4096
    bound = f"max_pixels={args.max_pixels:,}" if args.max_pixels else "each model's own max_pixels"
    head = (f"{'model':<50} {'weights':>10} {'KV/token':>9} {'image tok':>9} "
            + " ".join(f"{f'{g} GiB':>14}" for g in MATRIX_GIB) + f" {'usable px':>10} {'video tok':>9}")
    lines = [f"sequences of L={length} tokens (one image at {bound}) held at once (KV blocks of "
             f"{args.block_size}), {args.dtype}, gpu_memory_utilization={args.gpu_memory_utilization}; "
             "'-': no KV block fits beside the weights and the activation reserve, "
             f"'N*': one image at the checkpoint's bound is longer than L, so planned at the largest usable "
             f"image (usable px: max_pixels of at most {IMAGE_SHARE_OF_L:.0%} of L in visual tokens); 'img>L': the "
             f"--max-pixels image is longer than L; video tok: a {args.video_seconds:g} s clip at each family's "
             "default sampling ('-': no video, or none stated)", head]
    kv = getattr(args, "kv_cache_dtype", "auto")
    quant = getattr(args, "quantization", None)
    rows = [(quant, kv)]
    if quant is None:
        rows.append(("int4", kv))  # the int4 rows (group 128) beside the dense ones
    if kv == "auto":
        rows += [(q, "int8") for q, _ in rows]  # and both again with an 8-bit KV cache
    for q, k in rows:
        lines += [_row(plan_one, model, args, length, q, k) for model in CHAIN]
    if quant is None:  # Qwen3.5 runs dense weights only (docs/qwen3_5.md)
        slots = getattr(args, "max_num_seqs", 64)
        lines.append(f"Qwen3.5 (hybrid: KV/token counts the full-attention layers only; state/seq: conv + recurrent "
                     f"state bytes per sequence, any length, fp32; {slots} state slots (--max-num-seqs) off the "
                     f"budget first, so at most {slots} sequences), dense:")
        lines.append(head + f" {'state/seq':>12}")
        for k in dict.fromkeys(k for _, k in rows):  # auto, then int8 KV
            lines += [_row(plan_one, model, args, length, None, k, state=True) for model in HYBRID]
    return "\n".join(lines)
