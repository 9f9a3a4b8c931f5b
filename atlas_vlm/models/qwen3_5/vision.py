"""Qwen3.5's vision tower: Qwen3-VL's tower without DeepStack.

Source of the rule: HF transformers 5.25 ``modular_qwen3_5.py``. ``Qwen3_5VisionModel``
subclasses ``Qwen3VLVisionModel`` and only deletes ``deepstack_visual_indexes`` and
``deepstack_merger_list``; its forward is Qwen3-VL's minus the DeepStack taps, returning
``BaseModelOutputWithPooling`` (``pooler_output`` = the merged 2x2 patches). Every block
class (patch embed with Conv3d 16x16x2, learned position embedding interpolated
bilinearly from a ``sqrt(num_position_embeddings)`` grid, 2-D rotary, ViT blocks with
LayerNorm and a GELU-tanh MLP, the 2x2 merger) is the same code as Qwen3-VL's
(compared class by class with ``modeling_qwen3_vl.py``: identical). ``Qwen3_5VisionConfig`` is
Qwen3-VL's vision config without ``deepstack_visual_indexes``; released checkpoints still
write ``"deepstack_visual_indexes": []`` and ``"model_type": "qwen3_5"`` in it, which
transformers accepts (``Qwen3_5Config`` renames that model_type to ``qwen3_5_vision``).

So the decoder receives ONE feature per visual token, ``[num_tokens, out_hidden_size]``,
which replaces the ``<|image_pad|>`` / ``<|video_pad|>`` embeddings; nothing is added
after decoder layers. Videos take the same path as images (HF
``Qwen3_5Model.get_video_features`` calls ``get_image_features``).
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from mm_token_pipeline.vision import VisionEncoder

__all__ = ["Qwen3_5VisionEncoder"]


def as_qwen3_5_vision_config(vision_config) -> Qwen3_5VisionConfig:
    """A ``Qwen3_5VisionConfig`` from one, from a dict of its fields (a checkpoint's
    ``vision_config``: its ``model_type`` and an empty ``deepstack_visual_indexes`` are
    accepted and dropped), or from a full ``Qwen3_5Config``.

    Raises:
        ValueError: a non-empty ``deepstack_visual_indexes`` (a Qwen3-VL tower, not Qwen3.5's).
        TypeError: any other type.
    """
    if isinstance(vision_config, Qwen3_5Config):
        return vision_config.vision_config
    if isinstance(vision_config, Qwen3_5VisionConfig):
        return vision_config
    if isinstance(vision_config, dict):
        fields = {k: v for k, v in vision_config.items() if k not in ("model_type", "deepstack_visual_indexes")}
        if vision_config.get("deepstack_visual_indexes"):
            raise ValueError(f"vision_config has deepstack_visual_indexes {vision_config['deepstack_visual_indexes']}: "
                             "Qwen3.5's tower has no DeepStack (that is a Qwen3-VL tower)")
        return Qwen3_5VisionConfig(**fields)
    raise TypeError(f"vision_config must be a Qwen3_5VisionConfig, a dict of its fields or a Qwen3_5Config, "
                    f"got {type(vision_config).__name__}")


class Qwen3_5VisionEncoder(VisionEncoder):
    """Qwen3.5 vision tower (HF ``Qwen3_5VisionModel``), loaded strictly from the
    checkpoint's ``visual.*`` weights (prefix stripped).

    Loading, the grid check and ``encode_images`` are :class:`~mm_token_pipeline.vision.VisionEncoder`'s:
    ``encode_images(items)`` takes ``ProcessedImage`` / ``ProcessedVideo`` items (pixel
    rows ``[t*h*w, 3*2*16*16 = 1536]``) and returns one ``[num_tokens_i, out_hidden_size]``
    tensor per item, in one batched forward. Unlike Qwen3-VL's encoder there are no
    DeepStack columns: the width is the decoder's hidden size. HF's module runs as is
    (``FastQwenVisionTower`` covers only Qwen2-VL / Qwen2.5-VL towers).
    """

    @staticmethod
    def _resolve(vision_config):
        return as_qwen3_5_vision_config(vision_config), Qwen3_5VisionModel

    @classmethod
    def from_hf_config(cls, hf_config, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> "Qwen3_5VisionEncoder":
        """The tower of a Qwen3.5 checkpoint: ``hf_config.vision_config`` (a ``Qwen3_5Config``'s)
        loaded from ``state_dict`` (keys without ``'visual.'``), HF's module (``fast=False``).

        Raises:
            ValueError: missing / unexpected keys or shapes that do not fit (all named).
        """
        return cls.from_state_dict(hf_config.vision_config, state_dict, dtype=dtype, device=device, fast=False)
