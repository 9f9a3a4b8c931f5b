"""``KVBlockTier``: moves whole blocks between a ``PagedKVCache`` and a ``DiskKVTier``.

The ``BlockManager`` stays free of torch and files: it is handed an object with
``save(block_hash, block_id)``, ``load(block_hash, block_id) -> bool`` and
``contains(block_hash)``, and this is that object.

Policy: write-through. A full block is written to disk when the block manager first
registers it in the prefix cache (its K/V are computed: after the forward, in
``commit_computed``), skipped when its file exists. Chosen over write-on-eviction because
(1) what is on disk survives any restart, a crash or ``kill -9`` included, with no flush at
shutdown; (2) eviction happens inside allocation, where a slow or failing write would sit
on the admission path of an unrelated request; (3) hashes are chained, so the same file is
never written twice and each block costs one write in its lifetime. The price is a write
per new full block on the engine thread (one ``fsync`` each).
"""

from __future__ import annotations

from mm_kv_cache_management.disk_tier import DiskKVTier
from mm_kv_cache_management.kv_cache import PagedKVCache


class KVBlockTier:
    """Blocks of ``kv_cache`` saved to / loaded from ``disk``.

    Args:
        kv_cache: the paged cache (``k_cache`` / ``v_cache``:
            ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``).
        disk: the disk tier (its fingerprint must describe ``kv_cache``'s K/V).
    """

    def __init__(self, kv_cache: PagedKVCache, disk: DiskKVTier):
        self.kv_cache = kv_cache
        self.disk = disk
        spec = kv_cache.spec
        self.block_shape = (spec.num_layers, kv_cache.block_size, spec.num_kv_heads, spec.head_dim)

    def contains(self, block_hash: bytes) -> bool:
        """Whether the disk tier has a file for ``block_hash`` (``load`` verifies it)."""
        return self.disk.contains(block_hash)

    def save(self, block_hash: bytes, block_id: int) -> bool:
        """Write block ``block_id``'s K/V under ``block_hash`` (no-op if already on disk)."""
        return self.disk.save(block_hash, self.kv_cache.k_cache[:, block_id], self.kv_cache.v_cache[:, block_id])

    def load(self, block_hash: bytes, block_id: int) -> bool:
        """Copy ``block_hash``'s K/V from disk into block ``block_id``; False on a miss (the
        block is left as it was)."""
        kv = self.disk.load(block_hash, self.block_shape, self.kv_cache.spec.dtype)
        if kv is None:
            return False
        k, v = kv
        self.kv_cache.k_cache[:, block_id].copy_(k)
        self.kv_cache.v_cache[:, block_id].copy_(v)
        return True
