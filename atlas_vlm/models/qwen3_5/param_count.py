"""Qwen3.5's decoder parameter count from its text config alone (no weights, no model built).

Follows the module list of HF transformers 5.25 ``modeling_qwen3_5.py``
(``Qwen3_5Attention``, ``Qwen3_5GatedDeltaNet``, ``Qwen3_5MLP``, ``Qwen3_5RMSNorm``); the
checkpoint's ``mtp.*`` head, which HF does not build, is not counted.
"""

from __future__ import annotations


def qwen3_5_text_params(text, tied: bool) -> int:
    """Decoder parameters of a ``Qwen3_5TextConfig``: embeddings, every layer of
    ``layer_types`` (gated full attention or Gated DeltaNet, SwiGLU MLP, two norms), the final
    norm, and ``lm_head`` unless ``tied``."""
    h, hd, nh, nkv = text.hidden_size, text.head_dim, text.num_attention_heads, text.num_key_value_heads
    bias = bool(getattr(text, "attention_bias", False))
    full = h * (2 * nh + 2 * nkv) * hd + nh * hd * h + 2 * hd  # q_proj (query + gate), k, v, o; q/k norms
    full += bias * ((2 * nh + 2 * nkv) * hd + h)
    nv = text.linear_num_value_heads
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    value_dim = nv * text.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    linear = (h * (conv_dim + value_dim + 2 * nv)  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
              + conv_dim * text.linear_conv_kernel_dim + 2 * nv  # depthwise conv1d, dt_bias, A_log
              + text.linear_value_head_dim + value_dim * h)  # gated norm, out_proj
    shared = 3 * h * text.intermediate_size + 2 * h  # MLP, input / post-attention norms
    types = list(text.layer_types[:text.num_hidden_layers])
    layers = types.count("full_attention") * full + types.count("linear_attention") * linear
    return text.vocab_size * h * (1 if tied else 2) + layers + text.num_hidden_layers * shared + h
