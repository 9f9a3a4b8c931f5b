"""``ModelArch``: the shape of a supported decoder, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    # ---- models-vl branch (issue 9): Qwen3-VL, SmolVLM2 (Llama decoder)
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "SmolVLMForConditionalGeneration": "smolvlm",
    # ---- end models-vl
}
VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "smolvlm")  # decoder hyper-parameters under hf_config.text_config


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one Atlas VLM implements."""


@dataclass(frozen=True)
class ModelArch:
    """Decoder hyper-parameters (HF config field names in comments)."""

    family: str  # "llama" | "qwen2" | "qwen2_5_vl"
    vocab_size: int  # vocab_size
    hidden_size: int  # hidden_size
    intermediate_size: int  # intermediate_size
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim or hidden_size // num_attention_heads
    rms_norm_eps: float  # rms_norm_eps
    qkv_bias: bool  # Qwen2: True; Llama: attention_bias
    o_bias: bool  # Llama: attention_bias; Qwen2: False
    mlp_bias: bool  # Llama: mlp_bias
    hidden_act: str  # hidden_act
    tie_word_embeddings: bool  # tie_word_embeddings
    max_position_embeddings: int  # max_position_embeddings
    mrope_section: tuple[int, ...] | None  # rope_scaling["mrope_section"] (Qwen2.5-VL)
    mrope_interleaved: bool = False  # M-RoPE sections interleaved, not in blocks (Qwen3-VL)

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelArch":
        """Read a transformers config.

        Raises:
            UnsupportedModelError: architecture not in ``SUPPORTED_ARCHITECTURES``.
        """
        archs = list(getattr(hf_config, "architectures", None) or [])
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            family = {"llama": "llama", "qwen2": "qwen2", "qwen2_5_vl": "qwen2_5_vl",
                      "qwen3_vl": "qwen3_vl", "smolvlm": "smolvlm"}.get(hf_config.model_type)
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf_config.model_type!r}; "
                f"Atlas VLM runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        text = getattr(hf_config, "text_config", None) if family in VLM_FAMILIES else None
        text = text or hf_config
        scaling = getattr(text, "rope_scaling", None) or {}
        attention_bias = bool(getattr(text, "attention_bias", False))
        return cls(
            family=family,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            rms_norm_eps=text.rms_norm_eps,
            qkv_bias=True if family in ("qwen2", "qwen2_5_vl") else attention_bias,
            o_bias=attention_bias if family in ("llama", "qwen3_vl", "smolvlm") else False,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            hidden_act=text.hidden_act,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=text.max_position_embeddings,
            mrope_section=tuple(scaling["mrope_section"]) if "mrope_section" in scaling else None,
            mrope_interleaved=family == "qwen3_vl",  # HF Qwen3-VL always interleaves
        )
