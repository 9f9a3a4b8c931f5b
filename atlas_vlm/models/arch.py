"""``ModelArch``: the shape of a supported decoder, read from a Hugging Face config through
the model registry (``atlas_vlm.models.registry``)."""

from __future__ import annotations

from dataclasses import dataclass

from atlas_vlm.models.registry import SUPPORTED_ARCHITECTURES, UnsupportedModelError, resolve_family, text_config_of

__all__ = ["ModelArch", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError"]


@dataclass(frozen=True)
class ModelArch:
    """Decoder hyper-parameters (HF config field names in comments)."""

    family: str  # registry family name: "llama" | "qwen2" | "qwen3" | "qwen2_vl" | "qwen2_5_vl" | ...
    vocab_size: int  # vocab_size
    hidden_size: int  # hidden_size
    intermediate_size: int  # intermediate_size
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim or hidden_size // num_attention_heads
    rms_norm_eps: float  # rms_norm_eps
    qkv_bias: bool  # Qwen2: True; Llama / Qwen3: attention_bias
    o_bias: bool  # Llama / Qwen3: attention_bias; Qwen2: False
    mlp_bias: bool  # Llama: mlp_bias
    hidden_act: str  # hidden_act
    tie_word_embeddings: bool  # tie_word_embeddings
    max_position_embeddings: int  # max_position_embeddings
    mrope_section: tuple[int, ...] | None  # rope_scaling["mrope_section"] (Qwen2-VL, Qwen2.5-VL)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    mrope_interleaved: bool = False  # M-RoPE sections interleaved, not in blocks (Qwen3-VL)

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelArch":
        """Read a transformers config (the family comes from ``registry.resolve_family``).

        Raises:
            UnsupportedModelError: architecture not in ``SUPPORTED_ARCHITECTURES``.
        """
        fam = resolve_family(hf_config)
        text = text_config_of(hf_config, fam)
        scaling = getattr(text, "rope_scaling", None) or {}
        attention_bias = bool(getattr(text, "attention_bias", False))
        return cls(
            family=fam.name,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            rms_norm_eps=text.rms_norm_eps,
            qkv_bias=attention_bias if fam.qkv_bias is None else fam.qkv_bias,
            o_bias=attention_bias if fam.qkv_bias is None else False,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            hidden_act=text.hidden_act,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=text.max_position_embeddings,
            mrope_section=tuple(scaling["mrope_section"]) if "mrope_section" in scaling else None,
            qk_norm=fam.qk_norm,
            mrope_interleaved=fam.name == "qwen3_vl",  # HF Qwen3-VL always interleaves
        )
