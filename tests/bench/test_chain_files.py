"""The chain-size bench's pieces that need no llama.cpp build: the language-model configs
have the shipped checkpoints' text shapes, and the bytes a decode token reads are counted
from a GGUF's tensors (the input embedding left out only beside a separate LM head)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ sits beside tests/
from benchmarks.chain import bytes_per_token  # noqa: E402
from benchmarks.chain_files import CHAIN, REPO, text_config  # noqa: E402

pytestmark = pytest.mark.text


@pytest.mark.parametrize("name", list(CHAIN))
def test_language_model_configs_have_the_checkpoint_shapes(name):
    folder, text_type = CHAIN[name]
    raw = json.loads((REPO / "atlas_vlm" / "data" / "configs" / folder / "config.json").read_text())
    want = raw.get("text_config", raw) if text_type else raw
    cfg = text_config(name)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size"):
        assert getattr(cfg, key) == want.get(key, raw.get(key)), key
    assert cfg.tie_word_embeddings == want.get("tie_word_embeddings", raw.get("tie_word_embeddings"))
    assert cfg.model_type == (text_type or raw["model_type"])
    if text_type == "qwen3":
        assert cfg.head_dim == want["head_dim"] == 128


@pytest.mark.parametrize("separate_head", [False, True])
def test_bytes_per_token_counts_the_tensors_a_token_reads(tmp_path, separate_head):
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((100, 32), np.float32))  # 12,800 bytes
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), np.float16))  # 2,048 bytes
    if separate_head:
        w.add_tensor("output.weight", np.zeros((100, 32), np.float16))  # 6,400 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert bytes_per_token(path) == (2048 + 6400 if separate_head else 12800 + 2048)
