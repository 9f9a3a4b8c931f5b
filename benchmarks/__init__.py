"""Benchmarks of Atlas VLM against its peers, run in one process on the same prompts.

``scripts/bench.py`` is the command line; each section lives in its own module and returns a
plain dict (JSON-serialisable) and prints a markdown table:

- ``text`` : decode tokens/s, paged and contiguous cache vs HF ``generate``; KV waste.
- ``vlm``  : time to first token with one image vs HF Qwen2.5-VL ``generate``.
- ``video``: video TTFT and decode tokens/s on a 3 s and a 60 s clip (made with PyAV) vs HF
  Qwen2.5-VL ``generate`` on the same frames; ``load_video``'s peak RSS per clip.
- ``serve``: many requests: output tokens/s vs HF sequential, padded batches and HF
  continuous batching; KV reserved-but-empty; decode FLOP/s vs measured GEMM peak; a VLM mix
  with prefix + encoder caches on vs off.

Results are ratios against the peers; bare times are supporting columns. Greedy decoding
everywhere; our token ids are compared with HF's and the match is reported. No timing is
asserted anywhere (the design's "Performance method").
"""

from benchmarks.common import gemm_peak_flops, markdown_table

__all__ = ["gemm_peak_flops", "markdown_table"]
