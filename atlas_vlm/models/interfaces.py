"""What a model class supports, declared once (vLLM's ``vllm/model_executor/models/interfaces.py``).

Scope: the ``ModelCapabilities`` value and nothing else. Each decoder class declares its
capabilities as class attributes of ``models.decoder.CausalLM`` (overridden by the classes
that have them: ``takes_mm_in_forward``, ``quantizable``, ``supports_state_snapshots``,
``supports_state_rollback``, ``state_spec()``, ``num_kv_layers``, ``mtp_state_dict``,
``qkv_sizes``), and ``CausalLM.capabilities()`` turns them into this one frozen value. The
engine plan (``engine.plan.plan_engine``) reads that value; nothing else asks a model
whether it has an optional attribute.

To add a capability: one field here, its declaration on ``CausalLM`` (default) and on the
classes that have it, one line in ``CausalLM.capabilities``, then one plan field and one
builder branch (docs/architecture.md, "The engine plan").
"""

from __future__ import annotations

from dataclasses import dataclass

from mm_kv_cache_management import StateSpec


@dataclass(frozen=True)
class ModelCapabilities:
    """What one loaded decoder supports.

    Attributes:
        model_class: the class name (used in the plan's refusal messages).
        num_layers: decoder layers.
        num_kv_layers: layers that keep K/V (a hybrid model's full-attention layers; all
            layers otherwise), in ``1 .. num_layers``.
        state_spec: the per-sequence recurrent state of a hybrid model (``StateCache``'s
            shape); None for a model without recurrent-state layers.
        state_snapshots: its recurrent-state layers write snapshots at block boundaries
            (prefix caching can serve it).
        state_rollback: its recurrent-state layers keep the state after each verified row
            (speculative decoding can roll back rejected drafts).
        mtp: it keeps the checkpoint's multi-token-prediction head (``speculative="mtp"``).
        multimodal_in_forward: ``forward`` takes the step's media rows (Qwen3-VL DeepStack).
        quantizable: ``load_model(quantization=...)`` may quantize its linears.
        pooling: its final hidden states can be pooled (``PoolingParams``).
        qkv_sizes: rows of the fused ``qkv_proj`` per HF projection (None: heads x head_dim).
        lora: every decoder layer has the q/k/v/o/gate/up/down projections LoRA adapters
            wrap (``atlas_vlm.lora``; ``enable_lora=True``).

    Raises:
        ValueError: ``num_kv_layers`` outside ``1 .. num_layers`` (named with the class).
    """

    model_class: str
    num_layers: int
    num_kv_layers: int
    state_spec: StateSpec | None = None
    state_snapshots: bool = False
    state_rollback: bool = False
    mtp: bool = False
    multimodal_in_forward: bool = False
    quantizable: bool = True
    pooling: bool = True
    qkv_sizes: tuple[int, ...] | None = None
    lora: bool = False

    def __post_init__(self):
        n = self.num_kv_layers
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.num_layers:
            raise ValueError(f"{self.model_class}.num_kv_layers must be an int in 1..{self.num_layers} "
                             f"(its full-attention layers), got {n!r}")

    @property
    def hybrid(self) -> bool:
        """Recurrent-state layers beside attention (a ``StateCache`` per running sequence)."""
        return self.state_spec is not None
