"""KV-side bookkeeping and storage for Atlas VLM.

Owns which block of KV memory holds which token of which request (`BlockManager`,
`BlockTable`, `RequestState`), the KV tensors themselves (`PagedKVCache`, and the
`ContiguousKVCache` reference it is aligned to), capacity math, the chained block
hashes used by prefix caching, the per-sequence recurrent state of hybrid models'
linear-attention layers (`StateCache`), and the disk tier below the prefix cache (`DiskKVTier`,
`KVBlockTier`). Imports torch and the standard library only.
"""

from mm_kv_cache_management.block_manager import BlockManager, NoFreeBlocksError
from mm_kv_cache_management.block_table import BlockTable
from mm_kv_cache_management.disk_tier import DiskKVTier
from mm_kv_cache_management.hashing import block_hash
from mm_kv_cache_management.kv_cache import ContiguousKVCache, KVCacheSpec, PagedKVCache
from mm_kv_cache_management.kv_tier import KVBlockTier
from mm_kv_cache_management.request_state import (MediaItem, PlaceholderRange, RequestState, RequestStatus,
                                                   media_items)
from mm_kv_cache_management.state_cache import (NoFreeStateSlotsError, StateCache, StateMetadata, StateSpec)
from mm_kv_cache_management.state_config import state_spec_from_config

__all__ = [
    "BlockManager",
    "BlockTable",
    "ContiguousKVCache",
    "DiskKVTier",
    "KVBlockTier",
    "KVCacheSpec",
    "MediaItem",
    "NoFreeBlocksError",
    "NoFreeStateSlotsError",
    "PagedKVCache",
    "PlaceholderRange",
    "RequestState",
    "RequestStatus",
    "StateCache",
    "StateMetadata",
    "StateSpec",
    "block_hash",
    "media_items",
    "state_spec_from_config",
]
