"""The issue-19 rows of the bench's targets table: the Q4_1 GGUF as stored against
llama.cpp (>= 1.0x) and against the bandwidth limit of the bytes it reads (>= 60%)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ sits beside tests/
from benchmarks import targets  # noqa: E402

pytestmark = pytest.mark.text

LC = "single-request decode, Q4_1 GGUF as stored: ours / llama.cpp (issue 19)"
BW = "single-request decode, Q4_1 GGUF as stored: of the bandwidth limit of bytes read (issue 19)"


def test_quant_rows_read_the_gguf_run():
    decode = {"dense fp32": {"decode_tok_s": 15.0},
              "GGUF Q4_1 as stored, bfloat16": {"decode_tok_s": 50.0, "limit_tok_s": 200.0},
              "llama.cpp (GGUF as stored)": {"decode_tok_s": 100.0}}
    rows = {r["target"]: r for r in targets.rows({"quant": {"decode": decode}})}
    assert rows[LC]["measured"] == pytest.approx(0.5) and rows[LC]["goal"] == 1.0 and rows[LC]["met"] is False
    assert rows[BW]["measured"] == pytest.approx(0.25) and rows[BW]["goal"] == 0.6 and rows[BW]["met"] is False
    del decode["llama.cpp (GGUF as stored)"]
    rows = {r["target"]: r for r in targets.rows({"quant": {"decode": decode}})}
    assert rows[LC]["measured"] is None and rows[LC]["met"] is None
