"""SmolVLM2's vision tower: SigLIP + the pixel-shuffle connector, HF's own modules and
``get_image_features`` (transformers ``modeling_smolvlm``), loaded strictly from a state dict.
"""

from __future__ import annotations

import torch
from transformers.initialization import no_init_weights
from transformers.models.smolvlm.configuration_smolvlm import SmolVLMConfig
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMModel, SmolVLMVisionTransformer

from .tiles import SmolVLMTile

__all__ = ["SmolVLMVisionEncoder"]


class SmolVLMVisionEncoder(torch.nn.Module):
    """SigLIP tower + pixel-shuffle connector of SmolVLM (HF ``SmolVLMVisionTransformer`` and
    ``SmolVLMConnector``); features computed by HF's own ``SmolVLMModel.get_image_features``.

    ``encode(tiles)`` returns one ``[image_seq_len, text_hidden]`` tensor per tile.
    """

    get_image_features = SmolVLMModel.get_image_features  # HF's code, bound to this module

    def __init__(self, config: SmolVLMConfig, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not isinstance(config, SmolVLMConfig):
            raise TypeError(f"config must be a SmolVLMConfig (the full model config), got {type(config).__name__}")
        self.config = config
        with no_init_weights():  # weights come from a state dict
            self.vision_model = SmolVLMVisionTransformer._from_config(config.vision_config, dtype=dtype)
            self.connector = SmolVLMConnector(config).to(dtype)

    @classmethod
    def from_state_dict(cls, config: SmolVLMConfig, state_dict: dict[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "SmolVLMVisionEncoder":
        """Load ``vision_model.*`` and ``connector.*`` weights strictly.

        Raises:
            ValueError: missing or unexpected keys (listed), or shapes that do not fit.
        """
        encoder = cls(config, dtype=dtype)
        expected, given = set(encoder.state_dict()), set(state_dict)
        if expected != given:
            raise ValueError(f"SmolVLM vision state dict mismatch: missing keys {sorted(expected - given)[:8]}; "
                             f"unexpected keys {sorted(given - expected)[:8]}")
        try:
            encoder.load_state_dict(state_dict, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"SmolVLM vision state dict does not fit the config: {exc}") from exc
        return encoder.to(device=device, dtype=dtype).eval()

    #: the one constructor every family's tower has (``ModelFamily.vision_tower``): the FULL config
    from_hf_config = from_state_dict

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @torch.no_grad()
    def encode(self, tiles: list[SmolVLMTile]) -> list[torch.Tensor]:
        """One ``[image_seq_len, text_hidden]`` tensor per tile, in one batched forward."""
        if not tiles:
            return []
        device = next(self.parameters()).device
        pixel_values = torch.stack([t.pixel_values for t in tiles])[None].to(device)  # [1, n, 3, tile, tile]
        masks = torch.stack([t.pixel_attention_mask for t in tiles])[None].to(device)  # [1, n, tile, tile]
        # transformers 5: pooler_output holds, per batch row, its real tiles' rows flattened
        flat = torch.cat(self.get_image_features(pixel_values, masks).pooler_output)  # [n * image_seq_len, text_hidden]
        return list(flat.reshape(len(tiles), -1, flat.shape[-1]).unbind(0))  # n x [image_seq_len, text_hidden]
