"""The Qwen3.5 bench's model is the released Qwen3.5-0.8B decoder scaled as its docstring says
(widths / 4, head counts kept, layers / 3 in the same 3:1 pattern), and its two systems make the
same greedy tokens on a few short requests (fp32), so its ratios compare equal work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ sits beside tests/
from benchmarks import qwen3_5  # noqa: E402

pytestmark = pytest.mark.text

REPO = Path(__file__).resolve().parents[2]


def test_config_is_qwen3_5_0_8b_scaled():
    real = json.loads((REPO / "atlas_vlm/data/configs/Qwen3.5-0.8B/config.json").read_text())["text_config"]
    cfg = qwen3_5.config()
    for key in ("hidden_size", "intermediate_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim"):
        assert getattr(cfg, key) * 4 == real[key], key
    for key in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                "linear_conv_kernel_dim", "tie_word_embeddings"):
        assert getattr(cfg, key) == real[key], key
    assert cfg.num_hidden_layers * 3 == real["num_hidden_layers"]
    assert cfg.layer_types == real["layer_types"][:cfg.num_hidden_layers]
    assert cfg.rope_parameters["partial_rotary_factor"] == real["rope_parameters"]["partial_rotary_factor"]


def test_both_systems_make_the_same_greedy_tokens(tmp_path):
    from atlas_vlm import LLM

    hf = qwen3_5.build(tmp_path, torch.float32)
    prompts, outs = [[101, 202, 303, 404, 505], list(range(300, 340)), [7000] * 9], [6, 4, 5]
    _, ref = qwen3_5.hf_one_at_a_time(hf, prompts, outs)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4,
              num_kvcache_blocks=64)
    _, ids = qwen3_5.ours(llm, prompts, outs)
    assert [len(x) for x in ids] == outs
    assert ids == ref
