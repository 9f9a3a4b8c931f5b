"""The real-file parts of the chain and served benches that need no model: greedy agreement
counts positions and finds the first parting, the file list puts the real file first and
honours ``--quick`` and ``--chain-match``, the per-file table carries each side's figures and
ratios, and the served bench's copy-heavy edit is a 41-line function with the variable to rename."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ sits beside tests/
from benchmarks import chain, served_real  # noqa: E402
from benchmarks.chain_worker import agreement  # noqa: E402

pytestmark = pytest.mark.text


def test_agreement_counts_equal_positions_and_the_first_parting():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == {"equal": 4, "of": 4, "first_parting": None}
    assert agreement([1, 2, 9, 4], [1, 2, 3, 4]) == {"equal": 3, "of": 4, "first_parting": 2}
    assert agreement([1, 2], [1, 2, 3]) == {"equal": 2, "of": 3, "first_parting": 2}


@pytest.fixture
def files(monkeypatch, tmp_path):
    real = tmp_path / "real.gguf"
    monkeypatch.setattr(chain.real_file, "default_path", lambda: real)
    monkeypatch.setattr(chain.real_file, "is_correct", lambda p: p == real)
    monkeypatch.setattr(chain, "tools_missing", lambda: None)
    monkeypatch.setattr(chain, "chain_files", lambda name, types, log: {t: tmp_path / f"{name}-{t}" for t in types})
    return real


def test_the_real_file_runs_first_then_the_target(files):
    got, notes = chain._files(quick=False, match=None, log=print)
    assert got[0] == (*chain.REAL, files)
    assert got[1][:2] == chain.TARGET
    assert len(got) == 1 + 2 * len(chain.CHAIN) and notes == []


def test_quick_leaves_the_real_file_out_unless_matched(files):
    got, notes = chain._files(quick=True, match=None, log=print)
    assert [g[0] for g in got] == [list(chain.CHAIN)[0]] * 2 and "left out" in notes[0]
    got, _ = chain._files(quick=True, match="Coder", log=print)
    assert got == [(*chain.REAL, files)]


def test_an_absent_real_file_is_a_note(files, monkeypatch):
    monkeypatch.setattr(chain.real_file, "is_correct", lambda p: False)
    got, notes = chain._files(quick=False, match="3B", log=print)
    assert {g[0] for g in got} == {"Qwen2.5-VL-3B LM"} and "setup.sh --bench" in notes[0]


def test_figures_give_each_side_and_the_ratios():
    side = {"threads": 2, "load_s": 2.0, "decode_tok_s": 30.0, "ttft_512_s": 4.0, "mixed_64_tok_s": 90.0,
            "peak_rss_bytes": 2e9, "import_rss_bytes": 3e8}
    lc = {**side, "load_s": 1.0, "decode_tok_s": 20.0, "ttft_512_s": 6.0, "mixed_64_tok_s": 30.0, "peak_rss_bytes": 1e9}
    rows = chain.figures("f", {"ours": side, "llama.cpp": lc,
                               "agreement": [{"equal": 128, "of": 128, "first_parting": None},
                                             {"equal": 40, "of": 128, "first_parting": 37}]})
    by = {r[1]: r[2:] for r in rows}
    assert by["threads"] == [2, 2, "-"]
    assert by["decode tok/s, one stream"] == ["30.0", "20.0", "1.50"]
    assert by["load s (warm page cache)"][2] == "0.50"
    assert by["TTFT 512 tokens s"][2] == "1.50"  # llama.cpp's time / ours
    assert by["64 mixed requests tok/s"][2] == "3.00"
    assert by["peak RSS GB (after imports)"] == ["2.00 (0.30)", "1.00 (0.30)", "0.50"]
    assert by["chat prompt 1: greedy tokens equal"][:2] == ["128/128", "first parting at none"]
    assert by["chat prompt 2: greedy tokens equal"][:2] == ["40/128", "first parting at 37"]
    assert "TTFT 2,048 tokens s" not in by


def test_the_copy_heavy_edit_is_a_41_line_function():
    lines = served_real.FUNCTION.splitlines()
    assert len(lines) == 41 and lines[0].startswith("def ")
    assert "amount" in served_real.FUNCTION and "order_amount" not in served_real.FUNCTION
    assert served_real.FUNCTION in served_real.EDIT


def test_bench_cli_keeps_served_out_of_the_default_run():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cli", Path(__file__).resolve().parents[2] / "scripts" / "bench.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    quick = cli.parse_args(["--quick"])
    assert quick.chain and not quick.served and quick.chain_quantization is None and quick.chain_match is None
    served = cli.parse_args(["--served", "--chain-quantization", "gguf", "--chain-match", "Coder"])
    assert served.served and not served.chain and not served.text
    assert (served.chain_quantization, served.chain_match) == ("gguf", "Coder")
