"""Atlas VLM: a small, exact inference engine for (vision-)language models on a paged KV cache.

``LLM`` (facade) -> ``LLMEngine`` -> ``Scheduler`` / ``BlockManager`` / ``ModelRunner`` ->
``CausalLM`` -> layers (``paged_attention``).
"""

from atlas_vlm.config import EngineConfig
from atlas_vlm.engine import LLMEngine
from atlas_vlm.entrypoints.llm import LLM
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.pooling_params import PoolingParams
from atlas_vlm.sampling_params import RequestOutputKind, SamplingParams
from mm_token_pipeline import MultiModalOptions

__all__ = ["LLM", "EngineConfig", "LLMEngine", "MultiModalOptions", "PoolingParams", "RequestOutput", "RequestOutputKind", "SamplingParams"]
