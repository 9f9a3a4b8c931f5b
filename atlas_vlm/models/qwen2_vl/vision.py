"""Vision tower wrapper: ``VisionEncoder``.

Scope: a thin ``torch.nn.Module`` around HF transformers' Qwen vision towers: Qwen2.5-VL's
``Qwen2_5_VisionTransformerPretrainedModel`` (patch embed, windowed ViT blocks, 2x2 patch
merger) or Qwen2-VL's ``Qwen2VisionTransformerPretrainedModel`` (the same without window
attention), picked from the vision config's class, and loaded strictly from a state dict.
HF's module is the reference; after loading, ``from_state_dict`` swaps in our forward of the
same weights (``vision_fast.FastQwenVisionTower``: no per-window loop, fused/packable
linears) where ``fast_tower_unsupported`` allows it, else keeps HF's. This file adds loading
checks and the split of the output into one embedding matrix per image.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.initialization import no_init_weights
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from mm_token_pipeline.processor import ProcessedImage
from .vision_fast import FastQwenVisionTower, fast_tower_unsupported, tower_choice

__all__ = ["VisionEncoder"]


# vision config class -> HF tower class (transformers 4.57.6 names)
_TOWERS = {
    Qwen2_5_VLVisionConfig: Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2VLVisionConfig: Qwen2VisionTransformerPretrainedModel,
}


def _as_vision_config(vision_config) -> Qwen2_5_VLVisionConfig | Qwen2VLVisionConfig:
    """Accept a vision config, a dict of its fields (``model_type`` "qwen2_vl" selects
    Qwen2-VL; otherwise Qwen2.5-VL), or a full ``Qwen2_5_VLConfig`` / ``Qwen2VLConfig``."""
    if isinstance(vision_config, (Qwen2_5_VLConfig, Qwen2VLConfig)):
        return vision_config.vision_config
    if isinstance(vision_config, dict):
        fields = {k: v for k, v in vision_config.items() if k != "model_type"}
        if str(vision_config.get("model_type", "")).removesuffix("_vision") == "qwen2_vl":
            return Qwen2VLVisionConfig(**fields)
        return Qwen2_5_VLVisionConfig(**fields)
    if isinstance(vision_config, tuple(_TOWERS)):
        return vision_config
    raise TypeError(f"vision_config must be a Qwen2_5_VLVisionConfig, Qwen2VLVisionConfig, dict or a full "
                    f"Qwen2-VL / Qwen2.5-VL config, got {type(vision_config)}")


class VisionEncoder(torch.nn.Module):
    """Qwen2.5-VL or Qwen2-VL vision tower (HF ``Qwen2_5_VisionTransformerPretrainedModel`` /
    ``Qwen2VisionTransformerPretrainedModel``, chosen by the vision config's class).

    ``forward(pixel_values [num_patches, patch_dim], grid_thw [num_images, 3])`` returns
    ``[sum num_tokens, out_hidden_size]``: one row per merged 2x2 patch, images in order.
    ``patch_dim = in_channels * temporal_patch_size * patch_size**2`` (1176).
    """

    def __init__(self, vision_config, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
        super().__init__()
        config, tower_cls = self._resolve(vision_config)
        kwargs = {"dtype": dtype}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        with no_init_weights():  # weights come from a state dict; skip random init
            self.model = tower_cls._from_config(config, **kwargs)
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.tower_kind = "hf"  # "fast" once from_state_dict swaps in FastQwenVisionTower

    @staticmethod
    def _resolve(vision_config):
        """``(vision config, HF tower class)`` of this family (subclasses override)."""
        config = _as_vision_config(vision_config)
        return config, _TOWERS[type(config)]

    @classmethod
    def from_state_dict(cls, vision_config, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", attn_implementation: str | None = None,
                        fast: bool | None = None) -> "VisionEncoder":
        """Build the tower and load ``state_dict`` strictly (keys WITHOUT the ``'visual.'`` prefix).

        ``fast``: None (default) runs ``FastQwenVisionTower`` over the loaded weights where
        ``fast_tower_unsupported`` gives no reason (env ``ATLAS_VLM_VISION_TOWER=hf`` gives
        one), else HF's tower; False always HF's tower (the reference); True requires ours.
        ``ATLAS_VLM_VISION_TOWER=int8`` (fp32 only) adds ``FastQwenVisionTower.quantize_int8``.
        ``tower_kind`` says which ("fast" / "fast-int8" / "hf").

        Raises:
            ValueError: missing or unexpected keys (all listed), a shape mismatch,
                ``fast=True`` for a tower ours cannot run (the reason given), or int8 asked
                for a tower that is not fp32.
        """
        encoder = cls(vision_config, dtype=dtype, attn_implementation=attn_implementation)
        expected = set(encoder.model.state_dict().keys())
        given = set(state_dict.keys())
        missing, unexpected = sorted(expected - given), sorted(given - expected)
        if missing or unexpected:
            hint = " (strip the 'visual.' prefix)" if any(k.startswith("visual.") for k in unexpected) else ""
            raise ValueError(f"vision state dict mismatch{hint}: missing keys {missing}; unexpected keys {unexpected}")
        try:
            encoder.model.load_state_dict(state_dict, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"vision state dict does not fit the config: {exc}") from exc
        encoder = encoder.to(device=device, dtype=dtype).eval()
        if fast is not False:
            reason = fast_tower_unsupported(encoder.model)
            if reason is None:
                encoder.model, encoder.tower_kind = FastQwenVisionTower.from_hf(encoder.model), "fast"
                if tower_choice() == "int8" and encoder.model.quantize_int8():
                    encoder.tower_kind = "fast-int8"
            elif fast:
                raise ValueError(f"fast=True but the fast vision tower cannot run here: {reason}")
        return encoder

    @classmethod
    def from_hf_config(cls, hf_config, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> "VisionEncoder":
        """:meth:`from_state_dict` on ``hf_config.vision_config`` (the one constructor every
        family's tower has, named by ``ModelFamily.vision_tower``)."""
        return cls.from_state_dict(hf_config.vision_config, state_dict, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype of the tower."""
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Device of the tower's parameters."""
        return next(self.model.parameters()).device

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """Embeddings ``[sum_i t_i*h_i*w_i // merge**2, out_hidden_size]`` for ``[num_patches, patch_dim]`` input.

        Raises:
            ValueError: ``pixel_values`` rows differ from ``sum(t*h*w)`` of ``grid_thw``.
        """
        grid = torch.as_tensor(grid_thw, dtype=torch.long, device=self.device).reshape(-1, 3)  # [num_images, 3]
        n_patches = int(grid.prod(-1).sum())
        if pixel_values.dim() != 2 or pixel_values.shape[0] != n_patches:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} does not match grid_thw ({n_patches} patches)")
        return self._tower(pixel_values.to(device=self.device, dtype=self.dtype), grid)

    def _tower(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The HF tower's forward -> ``[sum num_tokens, columns]`` (subclasses override).
        transformers 5 returns a ``BaseModelOutputWithPooling`` whose ``pooler_output`` holds
        the merged patches; ``FastQwenVisionTower`` returns them directly."""
        if isinstance(self.model, FastQwenVisionTower):
            return self.model(pixel_values, grid)
        return self.model(pixel_values, grid_thw=grid).pooler_output

    @torch.no_grad()
    def encode(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """One ``[num_tokens_i, out_hidden_size]`` tensor per image, in one batched forward."""
        if not images:
            return []
        pixel_values = torch.cat([im.pixel_values for im in images], dim=0)  # [sum patches, patch_dim]
        embeds = self.forward(pixel_values, [im.grid_thw for im in images])
        return list(torch.split(embeds, [im.num_tokens for im in images], dim=0))
