"""Qwen3.5's language model over the paged KV cache and the per-sequence state cache.

Source of the rules: HF transformers 5.25 ``modeling_qwen3_5.py`` (``Qwen3_5TextModel``,
``Qwen3_5DecoderLayer``, ``Qwen3_5Attention``, ``Qwen3_5RMSNorm``, ``Qwen3_5MLP``,
``Qwen3_5TextRotaryEmbedding``). Decoder layers follow ``text_config.layer_types``:

- ``"full_attention"``: ``q_proj`` gives the query and an output gate (``2 x heads x head_dim``,
  per head ``[query | gate]``); per-head q/k RMSNorm; partial rotary (``partial_rotary_factor``)
  with interleaved M-RoPE; attention through ``paged_attention`` into KV layer = this layer's
  rank among the full-attention layers; output ``* sigmoid(gate)``, then ``o_proj``.
- ``"linear_attention"``: Gated DeltaNet (``gated_deltanet.GatedDeltaNet``), its state in
  ``meta.state`` at state layer = its rank among the linear-attention layers.

Qwen3.5's RMSNorm is zero-centred (``x * (1 + weight)``): it is its own class here
(``ZeroCentredRMSNorm``), the checkpoint's weights are loaded as stored (nothing folded in).
The MLP is our SwiGLU (``decoder.MLP``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from atlas_vlm.layers.attention import AttentionMetadata, paged_attention
from atlas_vlm.layers.rotary import RotaryEmbedding, apply_rotary
from atlas_vlm.models.decoder import MLP, CausalLM
from atlas_vlm.models.qwen3_5.gated_deltanet import GatedDeltaNet
from mm_kv_cache_management.state_cache import StateSpec
from mm_kv_cache_management.state_config import state_spec_from_config

if TYPE_CHECKING:  # annotations only: ModelArch.from_hf_config reads the registry, which names this module
    from atlas_vlm.models.arch import ModelArch

LINEAR, FULL = "linear_attention", "full_attention"


class ZeroCentredRMSNorm(nn.Module):
    """HF ``Qwen3_5RMSNorm``: ``rmsnorm(x) * (1 + weight)`` in fp32, cast back to ``x``'s dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    """HF ``Qwen3_5Attention`` with fused ``qkv_proj`` (rows: query+gate, key, value)."""

    def __init__(self, arch: ModelArch, kv_layer: int):
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = ZeroCentredRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.scale = arch.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, heads, head_dim] each
        gate = gate.reshape(-1, self.q_size)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, self.kv_layer, meta, self.scale).reshape(-1, self.q_size)
        return self.o_proj(out * torch.sigmoid(gate))


class DecoderLayer(nn.Module):
    """HF ``Qwen3_5DecoderLayer``: pre-norm token mixer (``self_attn`` or ``linear_attn``) and MLP."""

    def __init__(self, arch: ModelArch, text_config, layer_type: str, rank: int):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == FULL:
            self.self_attn = GatedAttention(arch, rank)
        else:
            self.linear_attn = GatedDeltaNet(text_config, rank)
        self.mlp = MLP(arch)
        self.input_layernorm = ZeroCentredRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        h = self.input_layernorm(x)
        if self.layer_type == FULL:
            h = self.self_attn(h, cos, sin, kv_cache, meta)
        else:
            h = self.linear_attn(h, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, arch: ModelArch, text_config):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        ranks = {FULL: 0, LINEAR: 0}
        layers = []
        for layer_type in text_config.layer_types[:arch.num_layers]:
            layers.append(DecoderLayer(arch, text_config, layer_type, ranks[layer_type]))
            ranks[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(text_config, list(arch.mrope_section), mrope_interleaved=arch.mrope_interleaved)


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5's decoder + LM head, with ``atlas_vlm.models.decoder.CausalLM``'s surface
    (``embed``, ``forward``, ``compute_logits``, ``arch``) plus ``state_spec()`` and
    ``num_kv_layers`` (the hybrid model's two cache groups).

    Attributes:
        qkv_sizes: rows of the fused ``qkv_proj`` per HF projection (``q_proj`` is query + gate,
            ``2 x heads x head_dim``); the loader stacks HF's q/k/v with these sizes.
        mtp_state_dict: the checkpoint's ``mtp.*`` tensors (multi-token prediction head, which
            HF ignores), names without the ``mtp.`` prefix, dtype as stored; the drafter of
            ``speculative="mtp"`` is built from them (``models.qwen3_5.mtp.build_mtp``).
        quantizable: False: ``load_model(quantization=...)`` refuses Qwen3.5 for now.
        supports_state_snapshots: True: its linear-attention layers write
            ``meta.state.snapshots`` (so prefix caching can serve it, ``state_snapshots.py``).
        supports_state_rollback: True: its linear-attention layers keep the state after each
            verified row (``meta.state.num_drafts``), so speculative decoding can roll the state
            back over rejected drafts (``StateCache.accept_rows``).

    Args:
        arch: hyper-parameters (``ModelArch.from_hf_config`` of a Qwen3.5 config).
        text_config: the HF ``Qwen3_5TextConfig`` (``layer_types``, linear-attention sizes, RoPE).

    Raises:
        ValueError: ``layer_types`` names a type other than full / linear attention or has
            fewer entries than ``num_hidden_layers``.
    """

    quantizable = False
    supports_state_snapshots = True
    supports_state_rollback = True
    supports_lora = False  # its linear-attention layers have no q/k/v/o projections (not wrapped yet)

    def __init__(self, arch: ModelArch, text_config):
        nn.Module.__init__(self)  # CausalLM's embed / compute_logits, not its plain decoder
        types = list(getattr(text_config, "layer_types", None) or [])
        if len(types) < arch.num_layers or set(types) - {FULL, LINEAR}:
            raise ValueError(f"text_config.layer_types must give {arch.num_layers} entries of {FULL!r} / "
                             f"{LINEAR!r}, got {types}")
        self.arch = arch
        self.text_config = text_config
        self.layer_types = types[:arch.num_layers]
        self.num_kv_layers = self.layer_types.count(FULL)
        q = arch.num_heads * arch.head_dim
        self.qkv_sizes = [2 * q, arch.num_kv_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim]
        self.mtp_state_dict: dict[str, torch.Tensor] = {}
        self.model = TextModel(arch, text_config)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def state_spec(self) -> StateSpec:
        """The per-sequence state of the linear-attention layers (``StateCache``'s shape):
        ``mm_kv_cache_management.state_spec_from_config`` of the text config, the rule the
        planner sizes it by."""
        return state_spec_from_config(self.text_config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Embeddings ``[num_tokens, hidden]`` -> final hidden states ``[num_tokens, hidden]``.

        Args:
            positions: M-RoPE ``[3, num_tokens]`` (text tokens: three equal rows); a 1-D
                ``[num_tokens]`` is taken as text positions.
            kv_cache: a paged / contiguous KV cache with ``num_kv_layers`` layers, or None for
                a cache-free full prefill.
            meta: the step's ``AttentionMetadata``; ``meta.state`` (a ``StateMetadata``) holds
                each sequence's state slot.

        Raises:
            ValueError: ``meta`` is not an ``AttentionMetadata`` (a compiled decode step's
                layout has no state slots), or see ``GatedDeltaNet.forward``.
        """
        if not isinstance(meta, AttentionMetadata):
            raise ValueError(f"Qwen3.5 needs an AttentionMetadata with state slots, got {type(meta).__name__}")
        if positions.dim() == 1:
            positions = positions[None].expand(3, -1)
        cos, sin = self.model.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)
