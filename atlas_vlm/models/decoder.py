"""The decoder of the Llama / Qwen2 / Qwen3 / Qwen2-VL / Qwen2.5-VL (text) family over a
paged KV cache.

RMSNorm, RoPE or M-RoPE, grouped-query attention through ``paged_attention`` (with Qwen3's
per-head q/k RMSNorm before RoPE when ``arch.qk_norm``), SwiGLU MLP.
Q/K/V and gate/up projections are fused (the loader stacks HF's separate weights). Inputs
are flattened across requests: ``[num_tokens]`` ids, ``[num_tokens]`` or ``[3, num_tokens]``
positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.activations import ACT2FN

from atlas_vlm.kernels import fused
from atlas_vlm.layers.attention import AttentionMetadata, paged_attention
from atlas_vlm.layers.rotary import RotaryEmbedding, apply_rotary
from atlas_vlm.models.interfaces import ModelCapabilities

if TYPE_CHECKING:  # annotations only: ModelArch.from_hf_config reads the registry, which names this module
    from atlas_vlm.models.arch import ModelArch


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as HF ``LlamaRMSNorm`` / ``Qwen2RMSNorm``
    (``fused.rms_norm``: one C call on CPU)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; ``residual`` may be updated in place."""
        return fused.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.scale = arch.head_dim**-0.5
        if arch.qk_norm:  # Qwen3 (HF Qwen3Attention): RMSNorm over head_dim, before RoPE
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, (heads + 2 kv_heads) * head_dim]
        if kv_cache is not None and isinstance(meta, AttentionMetadata):
            # q/k norms, RoPE and the K/V write in one step (fused.rope_write_kv); attention reads K/V from the cache
            q = fused.rope_write_kv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, kv_cache,
                                    self.layer_idx, meta.slot_mapping, self.q_norm, self.k_norm)
            k = v = None
        else:  # cache-free prefill, or a compiled decode step (its attention op writes K/V)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
            k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, self.layer_idx, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))  # [num_tokens, hidden]


class MLP(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        self.silu = arch.hidden_act == "silu"  # SwiGLU: fused.silu_and_mul
        self.act = ACT2FN[arch.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.silu:
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, cos, sin, kv_cache, meta):
        """``x`` ``[num_tokens, hidden]`` -> the layer's output; ``x`` itself may be updated in
        place (the residual of the fused add + norm)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        h, x = self.post_attention_layernorm.add_forward(attn, x)  # x + attn, and its norm
        return x + self.mlp(h)


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch, hf_text_config):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(hf_text_config, list(arch.mrope_section) if arch.mrope_section else None)


class CausalLM(nn.Module):
    """Decoder + LM head.

    Args:
        arch: hyper-parameters (``ModelArch.from_hf_config``).
        hf_text_config: the HF text config, for the RoPE variant and its scaling.

    Its capabilities are declared by the class attributes below (the defaults of a plain
    decoder; a class that has one overrides it) and read through ``capabilities()`` alone
    (``models.interfaces.ModelCapabilities``).
    """

    takes_mm_in_forward = False  # forward takes mm_embeds / mm_token_index (Qwen3-VL)
    quantizable = True  # load_model(quantization=...) may quantize its linears
    supports_state_snapshots = False  # hybrid: its state layers write snapshots (prefix caching)
    supports_state_rollback = False  # hybrid: its state layers keep per-verified-row state
    num_kv_layers: int | None = None  # hybrid: its full-attention layers (None: every layer)
    mtp_state_dict: dict | None = None  # the checkpoint's mtp.* tensors where the class keeps them
    qkv_sizes: list[int] | None = None  # rows of the fused qkv_proj per HF projection (None: heads x head_dim)
    supports_lora = True  # every layer has Attention.qkv_proj / o_proj and MLP.gate_up_proj / down_proj

    def state_spec(self):
        """The per-sequence recurrent state (``mm_kv_cache_management.StateSpec``) of a hybrid
        model; None here (no recurrent-state layers)."""
        return None

    def capabilities(self) -> ModelCapabilities:
        """This model's declared capabilities, as one frozen value (the plan's input).

        Raises:
            ValueError: a hybrid class's ``num_kv_layers`` outside ``1 .. num_layers``.
        """
        spec = self.state_spec()
        n = self.arch.num_layers if spec is None else self.num_kv_layers
        return ModelCapabilities(
            model_class=type(self).__name__, num_layers=self.arch.num_layers, num_kv_layers=n, state_spec=spec,
            state_snapshots=self.supports_state_snapshots, state_rollback=self.supports_state_rollback,
            mtp=self.mtp_state_dict is not None, multimodal_in_forward=self.takes_mm_in_forward,
            quantizable=self.quantizable, qkv_sizes=tuple(self.qkv_sizes) if self.qkv_sizes else None,
            lora=self.supports_lora)

    def __init__(self, arch: ModelArch, hf_text_config):
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch, hf_text_config)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
              mm_token_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings ``[num_tokens, hidden]``; rows ``mm_token_index`` replaced by ``mm_embeds``."""
        x = self.model.embed_tokens(input_ids)
        if mm_embeds is not None and mm_embeds.numel():
            x = x.index_copy(0, mm_token_index, mm_embeds.to(x.dtype))
        return x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Embeddings ``[num_tokens, hidden]`` -> final hidden states ``[num_tokens, hidden]``."""
        cos, sin = self.model.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> fp32 logits ``[n, vocab_size]``."""
        return self.lm_head(hidden).float()
