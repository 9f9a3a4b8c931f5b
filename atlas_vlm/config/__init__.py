"""The engine's settings: ``EngineConfig`` and its sub-configs (vLLM's ``VllmConfig`` layout).

Scope: re-exports. Where a setting lives (docs/library.md#where-settings-live):
``model_config`` (``model.py``: checkpoint, dtype, length, quantization, seed, parsers),
``cache_config`` (``cache.py``: KV cache), ``scheduler_config`` (``scheduler.py``: batch and
encoder budgets), ``multimodal_config`` (``multimodal.py``: pixel bounds and the one
``MediaFetchPolicy``), ``device_config`` (``device.py``: device, threads, attention backend,
compiled decode, batch invariance), ``speculative_config`` (``speculative.py``).
``engine.py`` routes the flat ``LLM(...)`` keywords to them. ``server.py``: ``ServerConfig``, the
server's own settings. ``cli.py`` generates the command-line flags from these fields (help from
their docstrings, read by ``docs.py``).
"""

from atlas_vlm.config.cache import DEFAULT_KV_CACHE_DIR_MAX_BYTES, KV_CACHE_KINDS, CacheConfig, kv_cache_dir_kwargs
from atlas_vlm.config.device import ATTENTION_BACKENDS, DeviceConfig
from atlas_vlm.config.engine import FLAT_ROUTES, SUB_CONFIGS, EngineConfig
from atlas_vlm.config.model import ModelConfig
from atlas_vlm.config.multimodal import MultiModalConfig
from atlas_vlm.config.scheduler import SchedulerConfig
from atlas_vlm.config.server import ServerConfig
from atlas_vlm.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from mm_token_pipeline.fetch_policy import MediaFetchPolicy

__all__ = ["ATTENTION_BACKENDS", "CacheConfig", "DEFAULT_KV_CACHE_DIR_MAX_BYTES", "DeviceConfig", "EngineConfig",
           "FLAT_ROUTES", "KV_CACHE_KINDS", "MediaFetchPolicy", "ModelConfig", "MultiModalConfig",
           "SPECULATIVE_METHODS", "SUB_CONFIGS", "SchedulerConfig", "ServerConfig", "SpeculativeConfig",
           "kv_cache_dir_kwargs"]
