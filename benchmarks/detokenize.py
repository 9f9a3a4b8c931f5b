"""Per-token cost of output processing (incremental detokenizing, stop strings, stream
deltas) against output length: the ``OutputProcessor`` should cost the same per token at
token 4000 as at token 100, where re-decoding the whole output each step (the engine's old
way) grows linearly. Tokenizer: the embedded SmolLM2's (converted GGUF). Times in seconds.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import now

TEXT = "The quick brown fox jumps over the lazy dog, isn't it? 中文 😀 Once upon a time. "


def _per_token(step, ids: list[int], window: int) -> tuple[float, float]:
    """Median seconds per token over the first and the last ``window`` tokens of ``ids``."""
    times = []
    for i in range(len(ids)):
        t0 = now()
        step(i)
        times.append(now() - t0)
    return statistics.median(times[:window]), statistics.median(times[-window:])


def run(quick: bool = False) -> dict:
    from transformers import AutoTokenizer

    from atlas_vlm import SamplingParams
    from atlas_vlm.default_models import default_text_model
    from atlas_vlm.engine.output_processor import OutputProcessor
    from atlas_vlm.loader import gguf_to_folder

    tok = AutoTokenizer.from_pretrained(gguf_to_folder(Path(default_text_model())))
    n = 1024 if quick else 4096
    ids = (tok.encode(TEXT * (n // 10), add_special_tokens=False))[:n]
    window = 128
    proc = OutputProcessor(tok)
    req = SimpleNamespace(request_id="r", finish_reason=None, error=None, logprobs=[], top_logprobs=[],
                          sampling_params=SamplingParams(stop=["never here", "zzz"]))
    proc.add_request("r", None, [1], req.sampling_params.stop)

    def ours(i):
        proc.process(req, [ids[i]])

    def whole(i):  # the old engine: decode all generated ids, then search every stop string
        text = tok.decode(ids[:i + 1], skip_special_tokens=True)
        for s in req.sampling_params.stop:
            text.find(s)

    res = {"output_tokens": len(ids), "window_tokens": window}
    for name, fn in (("output_processor", ours), ("whole_redecode", whole)):
        first, last = _per_token(fn, ids, window)
        res[name] = {"first_s_per_token": first, "last_s_per_token": last, "last_over_first": last / first}
    print(f"\n## Output processing cost per token (SmolLM2 tokenizer, {len(ids)} output tokens)\n")
    print("| method | first 128 tokens (us/token, median) | last 128 tokens (us/token, median) | last / first |")
    print("|---|---|---|---|")
    for name in ("output_processor", "whole_redecode"):
        r = res[name]
        print(f"| {name} | {r['first_s_per_token'] * 1e6:.1f} | {r['last_s_per_token'] * 1e6:.1f} | "
              f"{r['last_over_first']:.2f} |")
    return res
