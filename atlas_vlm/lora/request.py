"""``LoRARequest``: which PEFT adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

Scope: the value a caller hands to ``LLM.generate(..., lora_request=...)`` / ``LLM.chat`` and the
server builds from ``--lora-modules`` or ``/v1/load_lora_adapter``: the adapter's name, a
positive int id unique per adapter, and its folder (``adapter_config.json`` +
``adapter_model.safetensors``, as ``peft``'s ``save_pretrained`` writes). Field names are vLLM's.
Loading and checking the folder is ``atlas_vlm.lora.peft_adapter``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter, by name, id and folder (vLLM's ``LoRARequest``).

    Args:
        lora_name: the adapter's name (what ``model=`` names on the server).
        lora_int_id: a positive int, unique per adapter in one engine (vLLM's rule: 0 means
            "no adapter" in its kernels, so ids start at 1).
        lora_path: the PEFT adapter folder.
        base_model_name: the base model it was trained on (informational, as vLLM).

    Raises:
        ValueError: an empty name, an id that is not an int >= 1, or an empty path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1 (vLLM: 0 is 'no adapter'), "
                             f"got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty; pass the PEFT adapter folder")
        object.__setattr__(self, "lora_path", str(Path(self.lora_path)))

    @property
    def adapter_id(self) -> int:
        """``lora_int_id`` (vLLM's alias)."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """``lora_name`` (vLLM's alias)."""
        return self.lora_name

    @property
    def path(self) -> str:
        """``lora_path`` (vLLM's alias)."""
        return self.lora_path


def as_lora_requests(lora_request, n: int) -> list[LoRARequest | None]:
    """One entry per prompt from ``lora_request`` as ``LLM.generate`` takes it: None (no
    adapter), one ``LoRARequest`` for every prompt, or a list of ``n`` (each a ``LoRARequest``
    or None).

    Raises:
        TypeError: an entry that is neither a ``LoRARequest`` nor None.
        ValueError: a list whose length is not ``n``.
    """
    items = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(items) != n:
        raise ValueError(f"{n} prompts but {len(items)} lora_request entries")
    for item in items:
        if item is not None and not isinstance(item, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, a list of them (None: no adapter) or None, "
                            f"got {type(item).__name__}")
    return list(items)
