"""Qwen3-VL's part of the token pipeline: image geometry, chat template and vision tower.

Scope: what differs from Qwen2.5-VL. Images are resized with the same qwen-vl-utils
``smart_resize`` rule but with factor 32 (patch 16 x merge 2), so ``max_pixels`` allows at
most ``max_pixels // (32*32)`` visual tokens, and normalised with mean = std = 0.5 (the
``preprocessor_config.json`` of the Qwen3-VL checkpoints); patchify stays
``Qwen2VLImageProcessor(do_resize=False)`` with ``patch_size=16`` given explicitly, so the
slow processor's ignored-``size`` fault (transformers #42910) cannot change the grid.
The vision tower is HF's ``Qwen3VLVisionModel``: it returns the merged features and one
DeepStack feature per ``deepstack_visual_indexes`` entry; :class:`Qwen3VLVisionEncoder`
hands them back side by side in ONE tensor per image, so any slicing by token (chunked
prefill, encoder cache) keeps the DeepStack rows with the main ones.
M-RoPE positions for images follow the same rule as Qwen2.5-VL (HF
``Qwen3VLModel.get_rope_index`` differs only for videos): use :func:`get_rope_index`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.modeling_utils import no_init_weights
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from .processor import ProcessedImage

__all__ = ["QWEN3_VL_CHAT_TEMPLATE", "QWEN3_VL_IMAGE_MEAN", "QWEN3_VL_IMAGE_STD", "image_kwargs",
           "Qwen3VLVisionEncoder"]

#: Per-channel mean and std of Qwen3-VL's image processor (its preprocessor_config.json).
QWEN3_VL_IMAGE_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_IMAGE_STD = (0.5, 0.5, 0.5)

#: Qwen3-VL-Instruct chat template, reduced to what the engine uses (no tools, no video
#: timestamps): unlike Qwen2.5-VL there is NO default system prompt; one
#: ``<|vision_start|><|image_pad|><|vision_end|>`` per image item.
QWEN3_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def image_kwargs(hf_config) -> dict:
    """Keyword arguments of :func:`preprocess_image` for a Qwen2.5-VL or Qwen3-VL config:
    the tower's ``patch_size``, ``merge_size``, ``temporal_patch_size`` and, for Qwen3-VL,
    its normalisation (CLIP's for Qwen2.5-VL is ``preprocess_image``'s default)."""
    vc = hf_config.vision_config
    kwargs = dict(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                  temporal_patch_size=vc.temporal_patch_size)
    if getattr(hf_config, "model_type", None) == "qwen3_vl":
        kwargs.update(image_mean=QWEN3_VL_IMAGE_MEAN, image_std=QWEN3_VL_IMAGE_STD)
    return kwargs


class Qwen3VLVisionEncoder(torch.nn.Module):
    """Qwen3-VL vision tower (HF ``Qwen3VLVisionModel``: patch embed with learned position
    embedding, ViT blocks, 2x2 merger, DeepStack mergers).

    ``encode_images`` returns per image ``[num_tokens, out_hidden * (1 + K)]``: columns
    ``[0, out_hidden)`` are the merged features that replace the ``<|image_pad|>``
    embeddings, columns ``[(1+k)*out_hidden, (2+k)*out_hidden)`` the DeepStack feature
    added after decoder layer ``k`` (K = ``len(deepstack_visual_indexes)``).
    """

    def __init__(self, vision_config, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        if isinstance(vision_config, dict):
            vision_config = Qwen3VLVisionConfig(**vision_config)
        if not isinstance(vision_config, Qwen3VLVisionConfig):
            raise TypeError(f"vision_config must be a Qwen3VLVisionConfig or dict, got {type(vision_config).__name__}")
        with no_init_weights():  # weights come from a state dict; skip random init
            self.model = Qwen3VLVisionModel._from_config(vision_config, dtype=dtype)
        self.config = vision_config
        self.num_deepstack = len(vision_config.deepstack_visual_indexes)

    @classmethod
    def from_state_dict(cls, vision_config, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "Qwen3VLVisionEncoder":
        """Build the tower and load ``state_dict`` strictly (keys without the ``'visual.'`` prefix).

        Raises:
            ValueError: missing or unexpected keys (listed), or shapes that do not fit the config.
        """
        encoder = cls(vision_config, dtype=dtype)
        expected, given = set(encoder.model.state_dict()), set(state_dict)
        if expected != given:
            raise ValueError(f"Qwen3-VL vision state dict mismatch: missing keys {sorted(expected - given)[:8]}; "
                             f"unexpected keys {sorted(given - expected)[:8]}")
        try:
            encoder.model.load_state_dict(state_dict, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"Qwen3-VL vision state dict does not fit the config: {exc}") from exc
        return encoder.to(device=device, dtype=dtype).eval()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """``[num_patches, 3*2*16*16]`` patches -> ``[sum num_tokens, out_hidden * (1 + K)]``.

        Raises:
            ValueError: ``pixel_values`` rows differ from ``sum(t*h*w)`` of ``grid_thw``.
        """
        grid = torch.as_tensor(grid_thw, dtype=torch.long, device=self.device).reshape(-1, 3)  # [num_images, 3]
        n_patches = int(grid.prod(-1).sum())
        if pixel_values.dim() != 2 or pixel_values.shape[0] != n_patches:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} does not match grid_thw ({n_patches} patches)")
        merged, deepstack = self.model(pixel_values.to(device=self.device, dtype=self.model.dtype), grid_thw=grid)
        return torch.cat([merged, *deepstack], dim=-1)  # [num_tokens, out_hidden * (1 + K)]

    @torch.no_grad()
    def encode_images(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens_i, out_hidden * (1 + K)]`` tensor per image, in one batched forward."""
        if not images:
            return []
        pixel_values = torch.cat([im.pixel_values for im in images], dim=0)  # [sum patches, patch_dim]
        embeds = self.forward(pixel_values, [im.grid_thw for im in images])
        return list(torch.split(embeds, [im.num_tokens for im in images], dim=0))
