"""``LoRAConfig``: LoRA adapter serving (vLLM's ``LoRAConfig``; atlas_vlm.lora, docs/server.md).

Scope: the engine-wide LoRA settings, validated on creation: whether adapters are served,
how many are resident at once (fixed slots) and the rank every slot is padded to. The
adapters themselves come per request (``LoRARequest``) or from the server's
``--lora-modules`` / ``/v1/load_lora_adapter``. The messages name the flat ``EngineConfig(...)``
keyword (``enable_lora``, ``max_loras``, ``max_lora_rank``), which is also the CLI flag
(``--enable-lora``, ``--max-loras``, ``--max-lora-rank``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas_vlm.config.checks import check_positive

#: the largest max_lora_rank accepted (vLLM's list of supported ranks ends at 512)
MAX_LORA_RANK_LIMIT = 512


@dataclass
class LoRAConfig:
    """LoRA adapter settings.

    Raises:
        ValueError: on creation, ``max_loras`` / ``max_lora_rank`` not an int >= 1 (or the rank
            over ``MAX_LORA_RANK_LIMIT``); the message names the keyword.
    """

    #: Serve LoRA adapters (``lora_request=`` per request; the server's ``--lora-modules``,
    #: ``/v1/load_lora_adapter``). Off: no projection is wrapped, no slot memory is taken.
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters (PEFT format; per request "
                                                        "by model=NAME, --lora-modules, /v1/load_lora_adapter)"})
    #: Adapters resident at once (fixed slots; rows of all of them run in one step). An adapter
    #: with no request in flight leaves its slot to a new one, least recently used first.
    max_loras: int = field(default=4, metadata={"help": "LoRA adapters resident at once (fixed slots; rows of "
                                                       "all of them run in one step)"})
    #: Rank every slot holds (adapters of lower rank are zero-padded); an adapter of higher
    #: rank is refused at load. Slot memory: max_loras x max_lora_rank x sum(in + out) of
    #: q/k/v/o/gate/up/down x layers x dtype bytes.
    max_lora_rank: int = field(default=16, metadata={"help": "rank of every adapter slot; an adapter of higher "
                                                           "rank is refused at load"})

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        check_positive("max_loras", self.max_loras, " (adapter slots)")
        check_positive("max_lora_rank", self.max_lora_rank, " (rank)")
        if self.max_lora_rank > MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK_LIMIT}, got {self.max_lora_rank}")
