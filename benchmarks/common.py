"""Shared benchmark helpers: wall-clock timing, the measured GEMM peak, token comparison,
model locations and markdown tables.

Units: every time is in seconds (``time.perf_counter``), every rate is per second, FLOP
counts are plain floating-point operations (a multiply-add is 2).
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
IMAGE_DIRS = (Path("/work/shared/data/images"), REPO / "tests" / "data" / "images")


def now() -> float:
    """Wall clock in seconds (``time.perf_counter``)."""
    return time.perf_counter()


def best_of(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, object]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times.

    Returns:
        (best wall time in seconds, the result of the last call).
    """
    result = None
    for _ in range(warmup):
        result = fn()
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = now()
        result = fn()
        best = min(best, now() - t0)
    return best, result


def gemm_peak_flops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Measured matmul peak: best of ``repeats`` ``torch.matmul`` of two ``n x n`` matrices.

    Returns:
        FLOP/s (``2 * n**3`` operations per matmul divided by the best time in seconds).
    """
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    seconds, _ = best_of(lambda: torch.matmul(a, b), repeats)
    return 2 * n**3 / seconds


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the string ``LLM(dtype=...)`` and the CLI take."""
    return str(dtype).removeprefix("torch.")


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Measured memory read bandwidth: best of ``repeats`` ``torch.sum`` over an ``nbytes``
    fp32 tensor (far larger than any cache, so every byte comes from DRAM).

    Returns:
        bytes/s.
    """
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    seconds, _ = best_of(lambda: x.sum(), repeats)
    return nbytes / seconds


def nonembedding_params(hf_config) -> int:
    """Decoder parameters without the embedding table and the LM head, from the config
    (``atlas_vlm.models.param_count``; the engine's packed bf16 layers are not nn.Parameters)."""
    from atlas_vlm.models.param_count import text_config, text_params

    t = text_config(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text_params(hf_config) - t.vocab_size * t.hidden_size * (1 if tied else 2)


def decode_weight_bytes(hf_config, dtype: torch.dtype) -> int:
    """Weight bytes one decode token reads at batch 1: every parameter but the input embedding
    table (a token reads one row of it), plus the LM head (``d * V``; read once even when tied
    to the embedding), at ``dtype``'s element size."""
    from atlas_vlm.models.param_count import text_config

    t = text_config(hf_config)
    params = nonembedding_params(hf_config) + t.hidden_size * t.vocab_size
    return params * torch.empty((), dtype=dtype).element_size()


def text_model_paths() -> tuple[str, Path]:
    """(SmolLM2-135M GGUF file our engine loads, the converted HF folder HF loads): same weights."""
    from atlas_vlm.default_models import default_text_model
    from atlas_vlm.loader import gguf_to_folder

    gguf = default_text_model()
    return gguf, gguf_to_folder(Path(gguf))


def vlm_model_path() -> str:
    """The default random-weight Qwen2.5-VL folder (built once into the cache)."""
    from atlas_vlm.default_models import default_vlm_model

    return default_vlm_model()


def image_path(name: str) -> str:
    """A benchmark photo by file name, from the shared data folder or the test images."""
    for folder in IMAGE_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    raise FileNotFoundError(f"image {name!r} not found in {[str(d) for d in IMAGE_DIRS]}")


def random_prompts(num: int, lo: int, hi: int, vocab: tuple[int, int], seed: int) -> list[list[int]]:
    """``num`` prompts of random token ids in ``[vocab[0], vocab[1])``, lengths uniform in ``[lo, hi]``."""
    rng = random.Random(seed)
    return [[rng.randrange(*vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def compare_tokens(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """Greedy agreement of two runs over the same requests.

    Returns:
        {"requests_equal": requests whose ids are all equal, "requests": count,
        "tokens_equal": tokens before each request's first mismatch (summed), "tokens": total
        reference tokens, "match_rate": tokens_equal / tokens}. After a first mismatch the two
        continuations are different texts, so later tokens are not counted as matches.
    """
    eq_req = eq_tok = total = 0
    for a, b in zip(ours, ref):
        total += len(b)
        prefix = 0
        while prefix < min(len(a), len(b)) and a[prefix] == b[prefix]:
            prefix += 1
        eq_tok += prefix
        eq_req += int(a == b)
    return {"requests_equal": eq_req, "requests": len(ref), "tokens_equal": eq_tok, "tokens": total,
            "match_rate": eq_tok / total if total else 1.0}


def match_str(cmp: dict) -> str:
    """``"12/16 req, 97.3% tok"`` from ``compare_tokens``."""
    return f"{cmp['requests_equal']}/{cmp['requests']} req, {100 * cmp['match_rate']:.1f}% tok"


def fmt(x: float | None, digits: int = 2) -> str:
    """A number for a table cell; ``-`` for None."""
    if x is None:
        return "-"
    return f"{x:.{digits}f}"


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table (cells converted with ``str``)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section(title: str) -> None:
    """Print a section header."""
    print(f"\n## {title}\n", flush=True)


def log(msg: str) -> None:
    """Progress line (stdout, flushed)."""
    print(f"  .. {msg}", flush=True)
