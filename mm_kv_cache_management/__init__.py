"""KV-side bookkeeping and storage for Atlas VLM.

Owns which block of KV memory holds which token of which request (`BlockManager`,
`BlockTable`, `RequestState`), the KV tensors themselves (`PagedKVCache`, and the
`ContiguousKVCache` reference it is aligned to), capacity math, the chained block
hashes used by prefix caching, and the disk tier below the prefix cache (`DiskKVTier`,
`KVBlockTier`). Imports torch and the standard library only.
"""

from mm_kv_cache_management.block_manager import BlockManager, NoFreeBlocksError
from mm_kv_cache_management.block_table import BlockTable
from mm_kv_cache_management.disk_tier import DiskKVTier
from mm_kv_cache_management.hashing import block_hash
from mm_kv_cache_management.kv_cache import ContiguousKVCache, KVCacheSpec, PagedKVCache
from mm_kv_cache_management.kv_tier import KVBlockTier
from mm_kv_cache_management.request_state import PlaceholderRange, RequestState, RequestStatus

__all__ = [
    "BlockManager",
    "BlockTable",
    "ContiguousKVCache",
    "DiskKVTier",
    "KVBlockTier",
    "KVCacheSpec",
    "NoFreeBlocksError",
    "PagedKVCache",
    "PlaceholderRange",
    "RequestState",
    "RequestStatus",
    "block_hash",
]
