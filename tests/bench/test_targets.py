"""The issue-10 targets table of ``scripts/bench.py`` reads the right numbers off a run:
ratios are peer seconds / our seconds, fractions come from the sections' own fields, a peer
that did not run is "not measured", and "met" compares with each goal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ sits beside tests/
from benchmarks import targets  # noqa: E402

pytestmark = pytest.mark.text


def results(llama_cpp: bool = True) -> dict:
    systems = {"(a) ours, one generate call": {"seconds": 10.0}, "(b) HF generate, 1 at a time": {"seconds": 90.0},
               "(d) HF continuous batching": {"seconds": 25.0},
               "(e) llama.cpp, 1 at a time (GGUF as stored)": {"seconds": 29.0} if llama_cpp else {"error": "not installed"}}
    decode = {"ours paged": {"decode_tok_s": 60.0}, "HF generate": {"decode_tok_s": 40.0}}
    if llama_cpp:
        decode["llama.cpp (GGUF as stored)"] = {"decode_tok_s": 150.0}
    return {
        "serve": {"num_requests": 64, "dtype": "bfloat16", "systems": systems,
                  "decode_flops": [{"batch": 32, "frac_peak_step": 0.3}, {"batch": 64, "frac_peak_step": 0.55}]},
        "text": {"dtype": "bfloat16", "decode": decode, "bandwidth_limit_tok_s": 100.0,
                 "prefill": {"tokens": 2048, "systems": {"ours": {"frac_peak": 0.4}}}},
        "vlm": {"1024x28x28": {"speedup_hf_over_ours": 1.31}},
    }


def test_every_target_from_its_section():
    got = {r["target"]: (pytest.approx(r["measured"]), r["goal"], r["met"]) for r in targets.rows(results())}
    assert got == {
        "64 mixed requests: ours / HF generate one at a time": (9.0, 8, True),
        "64 mixed requests: ours / HF continuous batching": (2.5, 3, False),
        "64 mixed requests: ours / llama.cpp one at a time": (2.9, 3, False),
        "decode at batch 64: of the bfloat16 GEMM peak (whole engine step)": (0.55, 0.5, True),
        "2048-token prefill: of the bfloat16 GEMM peak": (0.4, 0.6, False),
        "single-request decode: ours / HF generate": (1.5, 1.2, True),
        "single-request decode: of the bandwidth limit": (0.6, 0.75, False),
        "single-request decode: ours / llama.cpp (reported, no target)": (0.4, 0, True),
        "image TTFT at 1024*28*28 pixels: HF / ours": (1.31, 1.3, True),
    }


def test_a_peer_that_did_not_run_is_not_measured():
    rows = {r["target"]: r for r in targets.rows(results(llama_cpp=False))}
    for name in ("64 mixed requests: ours / llama.cpp one at a time",
                 "single-request decode: ours / llama.cpp (reported, no target)"):
        assert rows[name]["measured"] is None and rows[name]["met"] is None
    assert targets.rows({}) == []
