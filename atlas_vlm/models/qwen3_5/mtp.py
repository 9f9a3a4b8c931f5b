"""Qwen3.5's multi-token-prediction (MTP) head: the draft model of ``speculative="mtp"``.

Source of the math: vLLM's ``qwen3_5_mtp.py`` / ``qwen3_next_mtp.py``
(``Qwen3NextMultiTokenPredictor.forward``). With the target's output hidden state ``h_t``
(after its final norm, what the target model returns) and the next token ``x_{t+1}``::

    e = pre_fc_norm_embedding(embed(x_{t+1}))
    z = fc(cat[e, pre_fc_norm_hidden(h_t)])          # [num_tokens, 2 * hidden] -> [num_tokens, hidden]
    z = layers.0(z)                                  # one full-attention decoder layer, position t
    out = norm(z)                                    # -> the shared lm_head: logits for x_{t+2}

``out`` also feeds the next draft step (vLLM passes the MTP's own output hidden state on).
The layer is ours (``model.DecoderLayer`` with a gated ``GatedAttention``); its K/V sit in the
paged cache as one more attention layer (``kv_layer``), written at the target's slots. The
checkpoint's tensors are ``mtp.*`` (kept on the model as ``mtp_state_dict``, prefix dropped);
the embedding and the LM head are the target's (``mtp_use_dedicated_embeddings`` false).
"""

from __future__ import annotations

import torch
from torch import nn

from atlas_vlm.checkpoint import copy_dense, our_name
from atlas_vlm.models.qwen3_5.model import FULL, DecoderLayer, ZeroCentredRMSNorm

__all__ = ["Qwen3_5MTP", "build_mtp", "mtp_weight_names"]


class Qwen3_5MTP(nn.Module):
    """The MTP head (one decoder layer; ``mtp_num_hidden_layers`` must be 1).

    Args:
        arch: the target's ``ModelArch``.
        text_config: the target's HF text config.
        kv_layer: the cache layer its attention reads and writes (the target's
            ``num_kv_layers``: the layer after the target's own).
    """

    def __init__(self, arch, text_config, kv_layer: int):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.kv_layer = kv_layer
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.layers = nn.ModuleList([DecoderLayer(arch, text_config, FULL, kv_layer)])
        self.norm = ZeroCentredRMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, kv_cache, meta) -> torch.Tensor:
        """``embeds`` ``[num_tokens, hidden]`` (of the next tokens) and the target's ``hidden``
        ``[num_tokens, hidden]`` at the same positions -> the MTP's output hidden states
        ``[num_tokens, hidden]`` (after ``mtp.norm``; the LM head gives the draft logits).
        ``cos`` / ``sin``, ``kv_cache``, ``meta``: as the target's layers take them."""
        z = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        z = self.fc(z)  # [num_tokens, hidden]
        for layer in self.layers:
            z = layer(z, cos, sin, kv_cache, meta)
        return self.norm(z)


def mtp_weight_names(mtp: Qwen3_5MTP) -> list[str]:
    """The checkpoint names (without ``mtp.``) ``mtp`` loads: HF's separate q/k/v and
    gate/up projections, as a released checkpoint stores them."""
    names = []
    for name in mtp.state_dict():
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{fused}." in name:
                names += [name.replace(fused, p) for p in parts]
                break
        else:
            names.append(name)
    return names


def build_mtp(model, kv_layer: int, model_name: str) -> Qwen3_5MTP:
    """The MTP head of a loaded ``Qwen3_5ForCausalLM`` from its ``mtp_state_dict``, in the
    model's dtype and device.

    Raises:
        ValueError: the model has no ``mtp.*`` tensors or lacks some (``model_name`` and the
            missing names given), a tensor's shape differs, or ``mtp_num_hidden_layers`` is
            not 1.
    """
    config = model.text_config
    layers = getattr(config, "mtp_num_hidden_layers", 1) or 1
    if layers != 1:
        raise ValueError(f"speculative='mtp' runs one MTP layer; {model_name} has mtp_num_hidden_layers={layers}")
    mtp = Qwen3_5MTP(model.arch, config, kv_layer)
    state = model.mtp_state_dict or {}  # declared (CausalLM; None: the class keeps no MTP head)
    missing = [n for n in mtp_weight_names(mtp) if n not in state]
    if missing:
        raise ValueError(f"speculative='mtp' needs the checkpoint's multi-token-prediction weights, but {model_name} "
                         f"lacks {len(missing)} of them: mtp.{', mtp.'.join(missing[:6])}"
                         f"{' ...' if len(missing) > 6 else ''}; use speculative='ngram' or a checkpoint with mtp.*")
    arch = model.arch
    qkv_sizes = model.qkv_sizes
    params = dict(mtp.named_parameters())
    with torch.no_grad():
        for hf_name, tensor in state.items():
            _, name, shard = our_name(hf_name)
            if name in params:
                copy_dense(params[name].data, name, shard, tensor, f"mtp.{hf_name}", arch, qkv_sizes)
    ref = next(model.parameters())
    return mtp.to(dtype=ref.dtype, device=ref.device).eval()
