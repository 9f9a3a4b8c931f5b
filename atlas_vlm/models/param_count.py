"""Parameter counts from a transformers config alone (no weights, no model built).

Scope: the decoder (Llama / Qwen2 / Qwen3 and the text side of Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, SmolVLM: the family's ``qkv_bias`` / ``qk_norm`` decide its attention's
parameters; Qwen3.5's hybrid decoder through its hooks' ``FamilyHooks.text_params``) and,
through each family's hooks (``FamilyHooks.vision_params`` in ``models/<family>/family.py``),
the vision towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and SmolVLM (SigLIP + pixel-shuffle connector). Each formula follows the module list of the HF
modeling file (transformers 4.57.6) named beside it; tests compare every count with
``sum(p.numel())`` of the HF model built on the meta device from the same config.
"""

from __future__ import annotations

from atlas_vlm.models.family_hooks import head_dim, linear_params, num_kv_heads, text_config
from atlas_vlm.models.registry import find_family

__all__ = ["head_dim", "linear_params", "num_kv_heads", "text_config", "text_params", "vision_params"]


def text_params(hf_config) -> int:
    """Decoder parameters: embeddings, layers (attention, SwiGLU MLP, 2 RMSNorms), final
    norm, and ``lm_head`` unless ``tie_word_embeddings`` (modeling_llama / qwen2 / qwen3)."""
    family = find_family(hf_config)  # None: a config no family names (its own attention_bias, no qk norm)
    own = family.family_hooks().text_params(hf_config) if family is not None else None
    if own is not None:  # a decoder of its own (Qwen3.5's hybrid layers: models/qwen3_5/family.py)
        return own
    t = text_config(hf_config)
    h, hd, nh, nkv, inter = t.hidden_size, head_dim(t), t.num_attention_heads, num_kv_heads(t), t.intermediate_size
    bias = bool(getattr(t, "attention_bias", False))
    fixed = family is not None and family.qkv_bias is not None  # Qwen2Attention: q/k/v bias, no o bias
    qkv_bias = family.qkv_bias if fixed else bias
    o_bias = False if fixed else bias
    attn = h * (nh + 2 * nkv) * hd + nh * hd * h + qkv_bias * (nh + 2 * nkv) * hd + o_bias * h
    if family is not None and family.qk_norm:  # Qwen3Attention: q_norm, k_norm over head_dim
        attn += 2 * hd
    mlp = 3 * h * inter + bool(getattr(t, "mlp_bias", False)) * (2 * inter + h)
    layer = attn + mlp + 2 * h
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return t.vocab_size * h * (1 if tied else 2) + t.num_hidden_layers * layer + h


def vision_params(hf_config) -> int:
    """Vision tower (+ connector) parameters; 0 for a text-only config.

    Raises:
        ValueError: a vision tower this module has no formula for.
    """
    v = getattr(hf_config, "vision_config", None)
    if v is None:
        return 0
    family = find_family(hf_config)
    if family is None or family.hooks is None:
        raise ValueError(f"no parameter count for vision tower {str(v.model_type).removesuffix('_vision')!r}")
    return family.family_hooks().vision_params(hf_config)
