"""``ModelArch``: the shape of a supported decoder, read from a Hugging Face config through
the model registry (``atlas_vlm.models.registry``)."""

from __future__ import annotations

from dataclasses import dataclass

from atlas_vlm.models.registry import SUPPORTED_ARCHITECTURES, UnsupportedModelError, resolve_family, text_config_of

__all__ = ["ModelArch", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "rope_parameters"]

#: Qwen3-VL's section when its config has none: HF ``Qwen3VLTextRotaryEmbedding``'s default.
QWEN3_VL_DEFAULT_MROPE_SECTION = (24, 20, 20)
#: Qwen3.5's section when its config has none: HF ``Qwen3_5TextRotaryEmbedding``'s default.
QWEN3_5_DEFAULT_MROPE_SECTION = (11, 11, 10)
_INTERLEAVED_MROPE = {"qwen3_vl": QWEN3_VL_DEFAULT_MROPE_SECTION, "qwen3_5": QWEN3_5_DEFAULT_MROPE_SECTION,
                      "qwen3_5_text": QWEN3_5_DEFAULT_MROPE_SECTION}


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
    mrope_interleaved: bool = False  # M-RoPE sections interleaved, not in blocks (Qwen3-VL, Qwen3.5)

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelArch":
        """Read a transformers config (the family comes from ``registry.resolve_family``).

        Raises:
            UnsupportedModelError: architecture not in ``SUPPORTED_ARCHITECTURES``.
            ValueError: a family that needs M-RoPE (Qwen2-VL, Qwen2.5-VL) whose config has no
                ``mrope_section`` under ``rope_parameters`` or ``rope_scaling`` (never run with
                1-D positions). Qwen3-VL / Qwen3.5 without one take HF's default ((24, 20, 20) /
                (11, 11, 10)).
        """
        fam = resolve_family(hf_config)
        text = text_config_of(hf_config, fam)
        section = rope_parameters(hf_config).get("mrope_section")
        if fam.mrope and section is None:
            if fam.name not in _INTERLEAVED_MROPE:
                raise ValueError(f"{fam.name} needs M-RoPE but its config has no mrope_section: set "
                                 "text_config.rope_parameters['mrope_section'] (transformers 5) or "
                                 "rope_scaling['mrope_section'] (transformers 4)")
            section = _INTERLEAVED_MROPE[fam.name]
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
            mrope_interleaved=fam.name in _INTERLEAVED_MROPE,  # HF Qwen3-VL and Qwen3.5 always interleave
        )
