"""Atlas VLM: a small, exact inference engine for (vision-)language models on a paged KV cache.

``LLM`` (facade) -> ``LLMEngine`` -> ``Scheduler`` / ``BlockManager`` / ``ModelRunner`` ->
``CausalLM`` -> layers (``paged_attention``).

The public names are imported on first use (PEP 562), so ``import atlas_vlm.entrypoints.cli``
(``atlas-vlm --help``, the CLI's input checks) does not pay for torch and the engine.
"""

from __future__ import annotations

import importlib
import os

# OpenMP threads (torch's, our C kernels') wait for work passively rather than spinning on a
# core another process may need (llama.cpp's default too); read once when an OpenMP runtime
# starts, so it is set here, before torch or a kernel library loads. A value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineConfig": "atlas_vlm.config",
    "LLMEngine": "atlas_vlm.engine",
    "LLM": "atlas_vlm.entrypoints.llm",
    "LoRARequest": "atlas_vlm.lora.request",
    "RequestOutput": "atlas_vlm.outputs",
    "PoolingParams": "atlas_vlm.pooling_params",
    "RequestOutputKind": "atlas_vlm.sampling_params",
    "SamplingParams": "atlas_vlm.sampling_params",
    "MultiModalOptions": "mm_token_pipeline",
}

if TYPE_CHECKING:
    from atlas_vlm.config import EngineConfig
    from atlas_vlm.engine import LLMEngine
    from atlas_vlm.entrypoints.llm import LLM
    from atlas_vlm.lora.request import LoRARequest
    from atlas_vlm.outputs import RequestOutput
    from atlas_vlm.pooling_params import PoolingParams
    from atlas_vlm.sampling_params import RequestOutputKind, SamplingParams
    from mm_token_pipeline import MultiModalOptions

__all__ = ["LLM", "EngineConfig", "LLMEngine", "LoRARequest", "MultiModalOptions", "PoolingParams", "RequestOutput", "RequestOutputKind", "SamplingParams"]


def __getattr__(name: str):
    """Import a public name on first access. Raises AttributeError: not a public name."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'atlas_vlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
