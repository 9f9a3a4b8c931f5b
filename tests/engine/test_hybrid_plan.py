"""The planner on hybrid configs (layer_types with linear attention, as Qwen3.5): KV bytes
count only the full-attention layers, the state slots (bytes per sequence, any length) and the
prefix cache's state snapshots (max_state_snapshots of the same size) come off the budget
first, and what plan prints is what the engine allocates."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, Qwen3_5TextConfig

from atlas_vlm.entrypoints.cli import main
from atlas_vlm.entrypoints.plan import format_plan
from atlas_vlm.memory_plan import GiB, plan
from hybrid_toy import build_tiny_llama
from test_hybrid_engine import make_llm

pytestmark = pytest.mark.text


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("hybrid_plan") / "llama4")


def test_qwen3_5_by_hand():
    c = Qwen3_5TextConfig(num_hidden_layers=32, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                          linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_conv_kernel_dim=4)
    p = plan(c, dtype="bf16", gpu_memory=80 * GiB, max_num_seqs=8)
    assert p.kv_bytes_per_token == 2 * 8 * 4 * 256 * 2  # (K, V) x 8 full-attention layers of 32 x heads x dim x bf16
    conv = (2 * 16 * 128 + 32 * 128) * 3  # q, k, v channels x (kernel - 1)
    assert p.state_bytes_per_seq == 24 * (conv + 32 * 128 * 128) * 4  # 24 linear layers, fp32
    assert p.state_bytes == 8 * p.state_bytes_per_seq and p.state_slots == 8
    assert p.state_snapshots == 16 and p.snapshot_bytes == 16 * p.state_bytes_per_seq  # the engine's default
    assert p.num_blocks == (p.kv_budget_bytes - p.state_bytes - p.snapshot_bytes) // p.kv_bytes_per_block
    assert p.max_num_seqs == 8  # as many sequences as state slots, though more blocks would fit
    text = format_plan(p)
    assert f"8 (max_num_seqs) x {p.state_bytes_per_seq:,} bytes" in text and "independent of its length" in text
    assert f"16 (max_state_snapshots) x {p.state_bytes_per_seq:,} bytes = {p.snapshot_bytes:,} bytes" in text
    off = plan(c, dtype="bf16", gpu_memory=80 * GiB, max_num_seqs=8, max_state_snapshots=0)
    assert off.num_blocks == (off.kv_budget_bytes - off.state_bytes) // off.kv_bytes_per_block
    assert "max_state_snapshots" not in format_plan(off)


def test_state_slots_larger_than_the_budget_fit_no_block():
    c = Qwen3_5TextConfig(num_hidden_layers=8)
    p = plan(c, dtype="bf16", gpu_memory=40 * GiB, max_num_seqs=100_000)
    assert p.num_blocks == 0 and not p.fits
    assert "of state slots (--max-num-seqs)" in p.why_not()


def test_plan_equals_what_the_engine_allocates(folder):
    budget = 1 << 20
    llm, _ = make_llm(folder, kv_cache_memory=budget)
    runner = llm.engine.runner
    assert runner.state_snapshots is None  # the toy mixer writes no snapshots: no pool (prefix caching off)
    p = plan(AutoConfig.from_pretrained(folder), dtype="fp32", block_size=runner.block_size,
             max_num_seqs=runner.state_cache.num_slots, max_state_snapshots=0)
    assert p.state_bytes == runner.state_cache.conv.nbytes + runner.state_cache.recurrent.nbytes
    assert p.state_bytes_per_seq == runner.state_cache.spec.bytes_per_seq
    assert p.kv_bytes_per_token == runner.kv_cache.spec.bytes_per_token == 2 * 1 * 2 * 16 * 4  # one KV layer
    assert runner.num_blocks == (budget - p.state_bytes) // p.kv_bytes_per_block
    assert runner.kv_cache.nbytes == runner.num_blocks * p.kv_bytes_per_block


def test_cli_prints_the_state_line(folder, capsys):
    assert main(["plan", "--model", str(folder), "--dtype", "fp32", "--max-num-seqs", "3"]) == 0
    out = capsys.readouterr().out
    per_seq = plan(AutoConfig.from_pretrained(folder), dtype="fp32").state_bytes_per_seq
    assert f"3 (max_num_seqs) x {per_seq:,} bytes = {3 * per_seq:,} bytes" in out
    assert f"16 (max_state_snapshots) x {per_seq:,} bytes = {16 * per_seq:,} bytes" in out
    assert main(["plan", "--model", str(folder), "--max-state-snapshots", "0"]) == 0
    assert "max_state_snapshots" not in capsys.readouterr().out
    assert main(["plan", "--model", str(folder), "--max-num-seqs", "0"]) != 0
    assert "--max-num-seqs must be >= 1" in capsys.readouterr().err
