"""Parameter counts from a transformers config alone (no weights, no model built).

Scope: the decoder (Llama / Qwen2 / Qwen3 and the text side of Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, SmolVLM; Qwen3.5's in ``models.qwen3_5.param_count``) and the vision towers of
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and SmolVLM
(SigLIP + pixel-shuffle connector). Each formula follows the module list of the HF
modeling file (transformers 4.57.6) named beside it; tests compare every count with
``sum(p.numel())`` of the HF model built on the meta device from the same config.
"""

from __future__ import annotations

_QKV_BIAS_TYPES = {"qwen2", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"}  # Qwen2Attention
_QK_NORM_TYPES = {"qwen3", "qwen3_vl", "qwen3_vl_text"}  # Qwen3Attention: q_norm, k_norm over head_dim


def text_config(hf_config):
    """The decoder's config (``get_text_config(decoder=True)``: itself for text models)."""
    return hf_config.get_text_config(decoder=True)


def head_dim(text) -> int:
    """``head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def num_kv_heads(text) -> int:
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def text_params(hf_config) -> int:
    """Decoder parameters: embeddings, layers (attention, SwiGLU MLP, 2 RMSNorms), final
    norm, and ``lm_head`` unless ``tie_word_embeddings`` (modeling_llama / qwen2 / qwen3; Qwen3.5:
    ``models.qwen3_5.param_count``)."""
    t = text_config(hf_config)
    if t.model_type == "qwen3_5_text":  # hybrid: Gated DeltaNet + gated full attention
        from atlas_vlm.models.qwen3_5.param_count import qwen3_5_text_params

        return qwen3_5_text_params(t, bool(getattr(hf_config, "tie_word_embeddings", False)))
    h, hd, nh, nkv, inter = t.hidden_size, head_dim(t), t.num_attention_heads, num_kv_heads(t), t.intermediate_size
    bias = bool(getattr(t, "attention_bias", False))
    qkv_bias = True if t.model_type in _QKV_BIAS_TYPES else bias
    o_bias = False if t.model_type in _QKV_BIAS_TYPES else bias
    attn = h * (nh + 2 * nkv) * hd + nh * hd * h + qkv_bias * (nh + 2 * nkv) * hd + o_bias * h
    if t.model_type in _QK_NORM_TYPES:
        attn += 2 * hd
    mlp = 3 * h * inter + bool(getattr(t, "mlp_bias", False)) * (2 * inter + h)
    layer = attn + mlp + 2 * h
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return t.vocab_size * h * (1 if tied else 2) + t.num_hidden_layers * layer + h


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _qwen_vision(v) -> int:
    """Qwen2-VL (``Qwen2VisionTransformerPretrainedModel``), Qwen2.5-VL
    (``Qwen2_5_VisionTransformerPretrainedModel``), Qwen3-VL (``Qwen3VLVisionModel``), Qwen3.5
    (``Qwen3_5VisionModel``, transformers 5.25: Qwen3-VL's modules without the DeepStack mergers)."""
    kind = v.model_type.removesuffix("_vision")  # transformers 5 names the towers "<family>_vision"
    d = v.embed_dim if kind == "qwen2_vl" else v.hidden_size
    out = v.hidden_size if kind == "qwen2_vl" else v.out_hidden_size
    m2 = v.spatial_merge_size**2
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * d  # Conv3d, no bias (Qwen2/2.5)
    if kind == "qwen2_vl":
        inter = int(d * v.mlp_ratio)
        block = 2 * 2 * d + _linear(d, 3 * d) + _linear(d, d) + _linear(d, inter) + _linear(inter, d)  # LayerNorms
        merger = 2 * d + _linear(d * m2, d * m2) + _linear(d * m2, out)
        return patch + v.depth * block + merger
    if kind == "qwen2_5_vl":
        inter = v.intermediate_size
        block = 2 * d + _linear(d, 3 * d) + _linear(d, d) + 2 * _linear(d, inter) + _linear(inter, d)  # RMSNorms, gated
        merger = d + _linear(d * m2, d * m2) + _linear(d * m2, out)
        return patch + v.depth * block + merger
    if kind in ("qwen3_vl", "qwen3_5"):
        inter = v.intermediate_size
        patch += d  # Conv3d with bias
        pos = v.num_position_embeddings * d
        block = 2 * 2 * d + _linear(d, 3 * d) + _linear(d, d) + _linear(d, inter) + _linear(inter, d)
        fcs = _linear(d * m2, d * m2) + _linear(d * m2, out)
        merger = 2 * d + fcs  # LayerNorm before the 2x2 shuffle
        taps = len(getattr(v, "deepstack_visual_indexes", None) or ())  # Qwen3.5: none
        deepstack = taps * (2 * d * m2 + fcs)  # LayerNorm after the shuffle
        return patch + pos + v.depth * block + merger + deepstack
    raise ValueError(f"no parameter count for vision tower {kind!r}")


def _siglip_vision(v, scale_factor: int, text_hidden: int) -> int:
    """SmolVLM / Idefics3 vision (``SmolVLMVisionTransformer``: SigLIP) + connector
    (``modality_projection``: one bias-free Linear after the pixel shuffle)."""
    d, inter = v.hidden_size, v.intermediate_size
    embeddings = _linear(v.num_channels * v.patch_size**2, d) + (v.image_size // v.patch_size) ** 2 * d
    layer = 2 * 2 * d + 4 * _linear(d, d) + _linear(d, inter) + _linear(inter, d)
    connector = d * scale_factor**2 * text_hidden
    return embeddings + v.num_hidden_layers * layer + 2 * d + connector


def vision_params(hf_config) -> int:
    """Vision tower (+ connector) parameters; 0 for a text-only config.

    Raises:
        ValueError: a vision tower this module has no formula for.
    """
    v = getattr(hf_config, "vision_config", None)
    if v is None:
        return 0
    if v.model_type in ("smolvlm_vision", "idefics3_vision"):
        return _siglip_vision(v, hf_config.scale_factor, text_config(hf_config).hidden_size)
    return _qwen_vision(v)
