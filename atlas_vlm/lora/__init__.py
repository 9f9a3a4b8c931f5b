"""LoRA adapters (vLLM's ``vllm.lora``): ``LoRARequest``, PEFT adapters checked at load
(``peft_adapter``), the slot manager (``manager.LoRAModelManager``) and the wrapped linears
applying each row's adapter per group of rows (``layers``: punica's shrink / expand).
docs/server.md, "LoRA adapters"."""

from atlas_vlm.lora.peft_adapter import TARGET_MODULES, LoRAAdapter, LoRAAdapterError, load_peft_adapter
from atlas_vlm.lora.request import LoRARequest, as_lora_requests

__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRARequest", "TARGET_MODULES", "as_lora_requests",
           "load_peft_adapter"]
