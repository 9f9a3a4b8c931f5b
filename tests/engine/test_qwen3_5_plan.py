"""``atlas-vlm plan`` on the released Qwen3.5 configs (bundled, so no Hub): the ``--matrix``
rows of 0.8B / 2B / 4B / 9B, and ``plan Qwen/Qwen3.5-4B`` offline. KV bytes per token count the
full-attention layers only; the state bytes per sequence (conv + recurrent, fp32) are worked
out here from each config.json, by hand."""

from __future__ import annotations

import json

import pytest

from atlas_vlm.entrypoints.cli import main
from atlas_vlm.entrypoints.plan import BUNDLED_CONFIGS, HYBRID, plan_model
from atlas_vlm.memory_plan import GiB

pytestmark = pytest.mark.text


def by_hand(name: str) -> tuple[int, int]:
    """(bf16 KV bytes per token, fp32 state bytes per sequence) from the bundled config."""
    c = json.loads((BUNDLED_CONFIGS / name.split("/")[-1] / "config.json").read_text())["text_config"]
    full = c["layer_types"].count("full_attention")
    linear = c["layer_types"].count("linear_attention")
    assert full + linear == c["num_hidden_layers"] and full == c["num_hidden_layers"] // c["full_attention_interval"]
    kv = full * 2 * c["num_key_value_heads"] * c["head_dim"] * 2  # (K, V) x heads x dim x bf16
    nk, nv, dk, dv = (c[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    conv = (2 * nk * dk + nv * dv) * (c["linear_conv_kernel_dim"] - 1)  # q, k, v channels x (kernel - 1)
    recurrent = nv * dk * dv
    return kv, linear * (conv + recurrent) * 4


def matrix_rows(capsys, *flags: str) -> dict[str, list[str]]:
    assert main(["plan", "--matrix", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("Qwen3.5 (hybrid")) + 2
    # after the name: weights (2 words), KV/token, image tok, 6 x "seqs (blocks)", usable px, video tok, state/seq
    return {" ".join(x.split()[:-19]): x.split()[-19:] for x in lines[start:]}


def test_matrix_rows_by_hand(capsys):
    rows = matrix_rows(capsys)
    assert list(rows) == [*HYBRID, *(f"{m} kv int8" for m in HYBRID)]
    expected = {"Qwen/Qwen3.5-0.8B": (12_288, 20_201_472), "Qwen/Qwen3.5-4B": (32_768, 52_690_944)}
    for model in HYBRID:
        kv, state = by_hand(model)
        if model in expected:
            assert (kv, state) == expected[model]  # 0.8B: 6 of 24 layers full, 18 x (18,432 + 262,144) x 4 bytes
        row = rows[model]
        assert row[2] == f"{kv:,}" and row[-1] == f"{state:,}"
        q8 = rows[f"{model} kv int8"]
        assert q8[2] == f"{kv // 2 // 256 * 258:,}" and q8[-1] == row[-1]  # 1-byte codes + a 2-byte scale per head
        p = plan_model(model, _args(), gpu_memory=24 * GiB, max_model_len=4096)
        assert p.state_bytes == 64 * state  # 64 slots (--max-num-seqs) off the budget first
        assert p.snapshot_bytes == 16 * state  # and the prefix cache's 16 state snapshots (max_state_snapshots)
        blocks = max(0, (p.kv_budget_bytes - (64 + 16) * state) // (16 * kv))
        assert row[11] == f"({blocks})" and p.num_blocks == blocks
        seqs = min(64, blocks // (4096 // 16))
        assert row[10].rstrip("*") == (str(seqs) if blocks else "-")


def test_state_column_is_the_same_at_any_length(capsys):
    short, long = matrix_rows(capsys, "--max-model-len", "1024"), matrix_rows(capsys, "--max-model-len", "32768")
    for model in HYBRID:
        assert short[model][-1] == long[model][-1] == f"{by_hand(model)[1]:,}"


def test_quantized_matrix_has_no_qwen3_5_rows(capsys):
    assert main(["plan", "--matrix", "--quantization", "int4"]) == 0
    assert "Qwen3.5" not in capsys.readouterr().out


def _args():
    import argparse

    from atlas_vlm.entrypoints.plan import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return sub.choices["plan"].parse_args([])


@pytest.mark.parametrize("model", ["Qwen/Qwen3.5-4B", "Qwen3.5-4B", "Qwen/Qwen3.5-0.8B"])
def test_plan_a_qwen3_5_hub_id_offline(capsys, tmp_path, monkeypatch, model):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: the bundled config answers
    assert main(["plan", "--model", model, "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    kv, state = by_hand(model)
    assert f"KV per token                    {kv:,} bytes" in out
    assert f"state slots (hybrid)            8 (max_num_seqs) x {state:,} bytes = {8 * state:,} bytes" in out
    assert "vision tower" in out and "visual tokens per image" in out


def test_int8_kv_rows_are_what_the_engine_allocates(tmp_path):
    """The matrix's ``kv int8`` Qwen3.5 rows: an 8-bit KV cache runs on a (tiny) Qwen3.5, and
    its bytes per token and state bytes are the plan's."""
    from transformers import AutoConfig

    from atlas_vlm import LLM, SamplingParams
    from atlas_vlm.memory_plan import plan
    from qwen3_5_helpers import build_tiny_qwen3_5, tiny_vl_config

    build_tiny_qwen3_5(tmp_path, seed=3, config=tiny_vl_config())
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=512, num_kvcache_blocks=64, max_num_seqs=4,
              kv_cache_dtype="int8")
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert len(out.token_ids) == 6
    runner = llm.engine.runner
    p = plan(AutoConfig.from_pretrained(tmp_path), dtype="fp32", kv_cache_dtype="int8", max_num_seqs=4)
    assert runner.kv_cache.spec.bytes_per_token == p.kv_bytes_per_token == 1 * 2 * 2 * (32 + 2)  # 1 full layer
    assert runner.state_cache.spec.bytes_per_seq == p.state_bytes_per_seq
