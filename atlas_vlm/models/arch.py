"""``ModelArch``: the shape of a supported decoder, read from a Hugging Face config through
the model registry (``atlas_vlm.models.registry``)."""

from __future__ import annotations

from dataclasses import dataclass

from atlas_vlm.layers.rotary import rope_parameters
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
    mrope_section: tuple[int, ...] | None  # rope_parameters / rope_scaling "mrope_section" (Qwen2/2.5/3-VL)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    mrope_interleaved: bool = False  # M-RoPE sections interleaved, not in blocks (Qwen3-VL)

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelArch":
        """Read a transformers config (the family comes from ``registry.resolve_family``).

        Raises:
            UnsupportedModelError: architecture not in ``SUPPORTED_ARCHITECTURES``.
            ValueError: a family that needs M-RoPE (Qwen2-VL, Qwen2.5-VL) whose config has no
                ``mrope_section`` under ``rope_parameters`` or ``rope_scaling`` (never run with
                1-D positions). A family with ``default_mrope_section`` (Qwen3-VL: HF
                ``Qwen3VLTextRotaryEmbedding``'s (24, 20, 20)) takes that instead.
        """
        fam = resolve_family(hf_config)
        text = text_config_of(hf_config, fam)
        section = rope_parameters(hf_config).get("mrope_section")
        if fam.mrope and section is None:
            if fam.default_mrope_section is None:
                raise ValueError(f"{fam.name} needs M-RoPE but its config has no mrope_section: set "
                                 "text_config.rope_parameters['mrope_section'] (transformers 5) or "
                                 "rope_scaling['mrope_section'] (transformers 4)")
            section = fam.default_mrope_section
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
            mrope_section=tuple(section) if fam.mrope else None,
            qk_norm=fam.qk_norm,
            mrope_interleaved=fam.mrope_interleaved,  # HF Qwen3-VL always interleaves
        )
