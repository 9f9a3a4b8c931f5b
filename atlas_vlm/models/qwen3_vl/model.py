"""Qwen3-VL's language model over the paged KV cache: Qwen3 attention (q/k RMSNorm per
head before RoPE, ``Attention`` with ``arch.qk_norm``), interleaved M-RoPE and DeepStack.

Source of the rules: HF transformers 4.57.6 ``modeling_qwen3_vl.py``
(``Qwen3VLTextAttention``, ``Qwen3VLTextModel.forward`` / ``_deepstack_process``).

DeepStack meets the engine through the image-embedding rows the runner already routes:
the vision tower hands back, per image token, ``[main | deepstack_0 | ... | deepstack_{K-1}]``
side by side (``atlas_vlm.models.qwen3_vl.vision.Qwen3VLVisionEncoder``), so

- a chunk that holds part of an image gets the matching rows of every DeepStack feature
  (``image_rows_for_chunk`` slices rows, all columns come along);
- the encoder cache keeps the DeepStack features with the main ones (one tensor per image);
- a prefix-cache hit that skips an image's tokens needs none: their K/V, computed with
  DeepStack when first prefilled, are reused as they are, and decode tokens have none.

After decoder layer ``k < K`` the hidden states at the image tokens of the step get
``deepstack_k`` added, as HF does for the whole prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atlas_vlm.layers.attention import AttentionMetadata
from atlas_vlm.layers.rotary import RotaryEmbedding
from atlas_vlm.models.decoder import CausalLM

if TYPE_CHECKING:  # annotations only: ModelArch.from_hf_config reads the registry, which names this module
    from atlas_vlm.models.arch import ModelArch


class Qwen3VLForCausalLM(CausalLM):
    """Qwen3-VL's decoder + LM head.

    ``forward`` and ``embed`` take the step's image rows ``mm_embeds``
    ``[n, hidden * (1 + K)]`` and their flat token indices ``mm_token_index`` ``[n]``.

    Args:
        arch: hyper-parameters (``ModelArch.from_hf_config`` of a Qwen3-VL config).
        hf_text_config: ``Qwen3VLTextConfig`` (RoPE theta and ``mrope_section``).
    """

    takes_mm_in_forward = True  # declared (CausalLM.capabilities): the runner passes mm_embeds / mm_token_index

    def __init__(self, arch: ModelArch, hf_text_config):
        super().__init__(arch, hf_text_config)  # arch.qk_norm: Attention carries q_norm / k_norm
        self.model.rotary = RotaryEmbedding(hf_text_config, list(arch.mrope_section), mrope_interleaved=arch.mrope_interleaved)

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
              mm_token_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings ``[num_tokens, hidden]``; rows ``mm_token_index`` replaced by the
        main columns ``mm_embeds[:, :hidden]``."""
        main = mm_embeds[:, :self.arch.hidden_size] if mm_embeds is not None else None
        return super().embed(input_ids, main, mm_token_index)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata,
                mm_embeds: torch.Tensor | None = None, mm_token_index: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings ``[num_tokens, hidden]`` -> final hidden states ``[num_tokens, hidden]``.

        Raises:
            ValueError: ``mm_embeds`` columns are not ``hidden * (1 + K)`` with K >= 0.
        """
        hidden = self.arch.hidden_size
        deepstack = []
        if mm_embeds is not None and mm_embeds.numel():
            if mm_embeds.shape[-1] % hidden:
                raise ValueError(f"mm_embeds has {mm_embeds.shape[-1]} columns, not a multiple of hidden {hidden}")
            deepstack = list(mm_embeds[:, hidden:].to(x.dtype).split(hidden, dim=-1))  # K x [n, hidden]
        cos, sin = self.model.rotary(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache, meta)
            if i < len(deepstack):
                x = x.index_add(0, mm_token_index, deepstack[i])  # HF _deepstack_process
        return self.model.norm(x)
