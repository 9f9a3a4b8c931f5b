"""Rotary position embeddings: plain RoPE (Llama, Qwen2), Qwen2.5-VL's M-RoPE,
Qwen3-VL's interleaved M-RoPE and partial rotary (Qwen3.5: ``partial_rotary_factor``).

The RoPE settings come from ``rope_parameters`` (here: either config layout, read for the
layers and for ``models.arch.ModelArch``). Plain
RoPE's inverse frequencies are HF's ``compute_default_rope_parameters``
(``1 / theta ** (arange(0, dim, 2) / dim)``); scaled variants (llama3, linear, dynamic, yarn,
...) come from transformers' ``ROPE_INIT_FUNCTIONS``, so they follow HF exactly. M-RoPE (Qwen2-VL paper,
HF ``apply_multimodal_rotary_pos_emb``) splits the rotary channels into ``mrope_section``
chunks taken from the temporal, height and width position rows. Interleaved M-RoPE
(Qwen3-VL, HF ``Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope``) takes the same counts
per axis but laid out round-robin: frequency ``j`` comes from H when ``j % 3 == 1`` and
``j < 3 * mrope_section[1]``, from W when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``,
else from T.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from atlas_vlm.kernels.fused import apply_rotary

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_parameters"]


def rope_parameters(hf_config) -> dict:
    """The RoPE settings of a (text) config as one dict, whichever layout wrote it.

    transformers >= 5 writes ``rope_parameters`` (``rope_theta``, ``rope_type``,
    ``mrope_section``, scaling fields); 4.x wrote ``rope_scaling`` (``type`` / ``rope_type``,
    ``mrope_section``, scaling fields) beside a top-level ``rope_theta``. Either may sit on the
    config itself or, for the VLMs, under ``text_config``: the text config's own settings win,
    the outer config fills what it lacks. Returned keys: ``rope_theta`` (default 10000.0, as
    HF's ``default_theta``), ``rope_type`` (``"default"`` when unset or ``"mrope"``), and every
    other key as found (``mrope_section``, ``factor``, ...).
    """
    layers = [c for c in (getattr(hf_config, "text_config", None), hf_config) if c is not None]
    merged: dict = {}
    for config in reversed(layers):  # outer first, then the text config over it
        found = {}
        for key in ("rope_scaling", "rope_parameters"):
            value = _as_dict(config, key)
            if value:
                found.update(value)
        theta = _as_dict(config, "rope_theta")
        if theta is not None and "rope_theta" not in found:
            found["rope_theta"] = theta
        merged.update({k: v for k, v in found.items() if v is not None})
    rope_type = merged.pop("type", None)
    merged["rope_type"] = merged.get("rope_type") or rope_type or "default"
    if merged["rope_type"] == "mrope":
        merged["rope_type"] = "default"
    merged.setdefault("rope_theta", 10000.0)
    return merged


def _as_dict(config, key):
    """``config.key`` for a transformers config or a plain dict (None when absent)."""
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return dict(value) if isinstance(value, dict) else value



class RotaryEmbedding(nn.Module):
    """cos/sin tables for a step's positions.

    Args:
        hf_text_config: the HF (text) config: RoPE settings (either layout), head dim.
        mrope_section: per-axis rotary pair counts (sums to ``head_dim // 2``), or ``None``.
        mrope_interleaved: lay the sections out interleaved (Qwen3-VL) instead of in blocks.
    """

    def __init__(self, hf_text_config, mrope_section: list[int] | None = None, mrope_interleaved: bool = False):
        super().__init__()
        params = rope_parameters(hf_text_config)
        if params["rope_type"] == "default":
            dim = getattr(hf_text_config, "head_dim", None) or \
                hf_text_config.hidden_size // hf_text_config.num_attention_heads
            dim = int(dim * params.get("partial_rotary_factor", 1.0))  # Qwen3.5: 0.25 (HF default rope init)
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        elif params["rope_type"] in ROPE_INIT_FUNCTIONS:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_text_config, "cpu")
        else:
            raise ValueError(f"unsupported rope_type {params['rope_type']!r}; known: default, "
                             f"{', '.join(ROPE_INIT_FUNCTIONS)}")
        # [head_dim // 2] fp32; a plain attribute (not a buffer) so model.to(bf16) keeps it exact
        self.inv_freq = inv_freq.float()
        self.mrope_section = mrope_section
        if mrope_section is not None:
            if 2 * sum(mrope_section) != 2 * inv_freq.numel():
                raise ValueError(f"mrope_section {mrope_section} must sum to head_dim // 2 = {inv_freq.numel()}")
            if mrope_interleaved:
                axis = _interleaved_axes(list(mrope_section), inv_freq.numel()).repeat(2)
            else:
                axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(list(mrope_section) * 2)])
            self.axis_of_channel = axis  # [head_dim]: position row (t, h, w) feeding each channel

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[num_tokens]`` (or ``[3, num_tokens]`` for M-RoPE) -> cos, sin
        ``[num_tokens, rotary_dim]`` (``head_dim`` unless ``partial_rotary_factor`` < 1)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            if self.mrope_section is not None:
                self.axis_of_channel = self.axis_of_channel.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq  # [(3,) num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [(3,) num_tokens, head_dim]
        if self.mrope_section is not None:
            if positions.dim() != 2 or positions.shape[0] != 3:
                raise ValueError(f"M-RoPE needs positions of shape [3, num_tokens], got {tuple(positions.shape)}")
            index = self.axis_of_channel[None, None, :].expand(1, *emb.shape[1:])  # [1, num_tokens, head_dim]
            emb = emb.gather(0, index)[0]  # [num_tokens, head_dim]: channel c from axis axis_of_channel[c]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def _interleaved_axes(mrope_section: list[int], num_freqs: int) -> torch.Tensor:
    """Axis (0 = T, 1 = H, 2 = W) of each of ``num_freqs`` frequencies, as HF
    ``Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope`` (transformers 4.57.6) lays them out."""
    axis = torch.zeros(num_freqs, dtype=torch.long)  # [head_dim // 2]
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset:mrope_section[dim] * 3:3] = dim
    return axis
