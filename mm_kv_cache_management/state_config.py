"""The ``StateSpec`` of a hybrid model, read from its HF text config: the one rule the memory
planner (``atlas_vlm.memory_plan``) and the engine's model side size the state cache by.

A config is hybrid when its ``layer_types`` holds ``"linear_attention"`` entries (HF
``Qwen3_5TextConfig``: three of every four layers Gated DeltaNet, the rest
``"full_attention"``). Per linear-attention layer and sequence (HF ``Qwen3_5GatedDeltaNet``):
the causal conv1d runs over ``conv_dim = 2 * key_dim + value_dim`` channels with
``key_dim = linear_num_key_heads * linear_key_head_dim`` and ``value_dim =
linear_num_value_heads * linear_value_head_dim`` (q, k and v are convolved together), with a
kernel of ``linear_conv_kernel_dim``; the recurrent state is ``[linear_num_value_heads,
linear_key_head_dim, linear_value_head_dim]`` (keys repeated to the value heads).
"""

from __future__ import annotations

from mm_kv_cache_management.state_cache import StateSpec

LINEAR_ATTENTION = "linear_attention"
_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")


def layer_types(text_config) -> list[str]:
    """The config's ``layer_types`` (every layer ``"full_attention"`` where it has none)."""
    types = getattr(text_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * text_config.num_hidden_layers


def is_hybrid(text_config) -> bool:
    """Whether some layer of ``text_config`` is a linear-attention (recurrent-state) layer."""
    return LINEAR_ATTENTION in layer_types(text_config)


def num_full_attention_layers(text_config) -> int:
    """Layers with a KV cache: those that are not linear attention (all of them for a plain decoder)."""
    return sum(t != LINEAR_ATTENTION for t in layer_types(text_config))


def state_spec_from_config(text_config) -> StateSpec | None:
    """The per-sequence state of ``text_config``'s linear-attention layers; None for a model
    without any.

    Raises:
        ValueError: a hybrid config missing one of the ``linear_*`` fields (named), or whose
            ``layer_types`` length differs from ``num_hidden_layers``.
    """
    types = layer_types(text_config)
    if LINEAR_ATTENTION not in types:
        return None
    if len(types) != text_config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is "
                         f"{text_config.num_hidden_layers}")
    missing = [f for f in _FIELDS if getattr(text_config, f, None) is None]
    if missing:
        raise ValueError(f"hybrid config (layer_types with {LINEAR_ATTENTION!r}) lacks {', '.join(missing)}")
    c = text_config
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    return StateSpec(num_layers=types.count(LINEAR_ATTENTION), conv_dim=2 * key_dim + value_dim,
                     conv_kernel=c.linear_conv_kernel_dim, num_v_heads=c.linear_num_value_heads,
                     k_head_dim=c.linear_key_head_dim, v_head_dim=c.linear_value_head_dim)
