"""KV-side bookkeeping and storage for Atlas VLM.

Owns which block of KV memory holds which token of which request (`BlockManager`,
`BlockTable`, `RequestState`), the KV tensors themselves (`PagedKVCache`, and the
`ContiguousKVCache` reference it is aligned to), capacity math, and the chained block
hashes used by prefix caching. Imports torch and the standard library only.
"""

from mm_kv_cache_management.block_manager import BlockManager, NoFreeBlocksError
from mm_kv_cache_management.block_table import BlockTable
from mm_kv_cache_management.hashing import block_hash
from mm_kv_cache_management.kv_cache import ContiguousKVCache, KVCacheSpec, PagedKVCache
from mm_kv_cache_management.request_state import PlaceholderRange, RequestState, RequestStatus

__all__ = [
    "BlockManager",
    "BlockTable",
    "ContiguousKVCache",
    "KVCacheSpec",
    "NoFreeBlocksError",
    "PagedKVCache",
    "PlaceholderRange",
    "RequestState",
    "RequestStatus",
    "block_hash",
]
