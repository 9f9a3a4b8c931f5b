"""Which vision tower a checkpoint uses: ``build_vision_encoder``.

Scope: one dispatch on the HF config's ``model_type`` so the runner builds any family's
tower with one call. Every tower exposes ``encode_images(items) -> list[Tensor]`` (one
``[num_tokens_i, columns]`` tensor per image item, in order):

- Qwen2.5-VL (and Qwen2-VL): :class:`VisionEncoder` from ``hf_config.vision_config``;
- Qwen3-VL: :class:`~mm_token_pipeline.qwen3_vl.Qwen3VLVisionEncoder` (main + DeepStack columns);
- SmolVLM2: :class:`~mm_token_pipeline.smolvlm.SmolVLMVisionEncoder` from the FULL config
  (its connector needs ``scale_factor`` and the text hidden size); one item per tile.
"""

from __future__ import annotations

import torch

__all__ = ["build_vision_encoder"]


def build_vision_encoder(hf_config, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> torch.nn.Module:
    """Build the tower of ``hf_config``'s family and load ``state_dict`` strictly.

    Args:
        hf_config: the model's full transformers config.
        state_dict: the tower's weights, keys as the loader hands them back.

    Raises:
        ValueError: the weights do not fit the tower (from each family's ``from_state_dict``).
    """
    kind = getattr(hf_config, "model_type", None)
    if kind == "qwen3_vl":
        from .qwen3_vl import Qwen3VLVisionEncoder

        return Qwen3VLVisionEncoder.from_state_dict(hf_config.vision_config, state_dict, dtype=dtype, device=device)
    if kind == "smolvlm":
        from .smolvlm import SmolVLMVisionEncoder

        return SmolVLMVisionEncoder.from_state_dict(hf_config, state_dict, dtype=dtype, device=device)
    from .vision import VisionEncoder

    return VisionEncoder.from_state_dict(hf_config.vision_config, state_dict, dtype=dtype, device=device)
