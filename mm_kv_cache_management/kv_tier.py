"""``KVBlockTier``: moves whole blocks between a ``PagedKVCache`` and a ``DiskKVTier``.

The ``BlockManager`` stays free of torch and files: it is handed an object with
``save(block_hash, block_id)``, ``load(block_hash, block_id) -> bool`` and
``contains(block_hash)``, and this is that object.

A hybrid model's state snapshots (``StateSnapshotPool``) travel with their blocks: a snapshot
the block manager validates is written beside its block (``save_snapshot``), and a disk hit
may only end at a block whose snapshot is in the pool or loads from disk into it
(``load_snapshot``), from where it is restored into the request's state slot exactly as a
memory hit's.

Policy: write-through. A full block is written to disk when the block manager first
registers it in the prefix cache (its K/V are computed: after the forward, in
``commit_computed``), skipped when its file exists. Chosen over write-on-eviction because
(1) what is on disk survives any restart, a crash or ``kill -9`` included, with no flush at
shutdown; (2) eviction happens inside allocation, where a slow or failing write would sit
on the admission path of an unrelated request; (3) hashes are chained, so the same file is
never written twice and each block costs one write in its lifetime. The price is a write
per new full block on the engine thread (one ``fsync`` each).

An 8-bit cache (``kv_cache_dtype`` "int8" / "fp8_e4m3") stores each token's codes and its
float16 scales side by side as bytes: K (and V) of a block is one uint8 tensor
``[num_layers, block_size, num_kv_heads, head_dim + 2]`` (the last two bytes: the scale), so
the file format is the same; the fingerprint names the KV format.
"""

from __future__ import annotations

import torch

from mm_kv_cache_management.disk_tier import SNAPSHOT_SUFFIX, DiskKVTier
from mm_kv_cache_management.kv_cache import PagedKVCache


class KVBlockTier:
    """Blocks of ``kv_cache`` saved to / loaded from ``disk``.

    Args:
        kv_cache: the paged cache (``k_cache`` / ``v_cache``:
            ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``).
        disk: the disk tier (its fingerprint must describe ``kv_cache``'s K/V, and the state).
        state_snapshots: a hybrid model's ``StateSnapshotPool`` (None otherwise).
    """

    def __init__(self, kv_cache: PagedKVCache, disk: DiskKVTier, state_snapshots=None):
        self.kv_cache = kv_cache
        self.disk = disk
        self.state_snapshots = state_snapshots
        spec = kv_cache.spec
        scale_bytes = 2 if spec.quantized else 0  # a float16 scale per (token, KV head)
        self.block_shape = (spec.num_layers, kv_cache.block_size, spec.num_kv_heads, spec.head_dim + scale_bytes)
        self.file_dtype = torch.uint8 if spec.quantized else spec.dtype

    def _stored(self, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """One block's K (or V) as written: the values, or codes + scales as bytes."""
        if scale is None:
            return codes
        # [L, bs, kvh, hd] codes ++ [L, bs, kvh, 2] scale bytes -> [L, bs, kvh, hd + 2]
        return torch.cat([codes.view(torch.uint8), scale.unsqueeze(-1).view(torch.uint8)], dim=-1)

    def _restore(self, data: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Copy a block read from disk into its cache slices (inverse of ``_stored``)."""
        if scale is None:
            codes.copy_(data)
            return
        hd = codes.shape[-1]
        codes.copy_(data[..., :hd].view(codes.dtype))
        scale.copy_(data[..., hd:].contiguous().view(torch.float16).squeeze(-1))

    def contains(self, block_hash: bytes) -> bool:
        """Whether the disk tier has a file for ``block_hash`` (``load`` verifies it)."""
        return self.disk.contains(block_hash)

    def save(self, block_hash: bytes, block_id: int) -> bool:
        """Write block ``block_id``'s K/V under ``block_hash`` (no-op if already on disk)."""
        c = self.kv_cache
        k_scale = None if c.k_scale is None else c.k_scale[:, block_id]
        v_scale = None if c.v_scale is None else c.v_scale[:, block_id]
        return self.disk.save(block_hash, self._stored(c.k_cache[:, block_id], k_scale),
                              self._stored(c.v_cache[:, block_id], v_scale))

    def load(self, block_hash: bytes, block_id: int) -> bool:
        """Copy ``block_hash``'s K/V from disk into block ``block_id``; False on a miss (the
        block is left as it was)."""
        kv = self.disk.load(block_hash, self.block_shape, self.file_dtype)
        if kv is None:
            return False
        k, v = kv
        c = self.kv_cache
        self._restore(k, c.k_cache[:, block_id], None if c.k_scale is None else c.k_scale[:, block_id])
        self._restore(v, c.v_cache[:, block_id], None if c.v_scale is None else c.v_scale[:, block_id])
        return True

    # ---- state snapshots (hybrid models) ------------------------------------------------
    def contains_snapshot(self, block_hash: bytes) -> bool:
        """Whether the disk tier has a snapshot file for ``block_hash`` (``load_snapshot`` verifies)."""
        return self.state_snapshots is not None and self.disk.contains(block_hash, SNAPSHOT_SUFFIX)

    def save_snapshot(self, block_hash: bytes) -> bool:
        """Write the pool's valid snapshot of ``block_hash`` beside its block (no-op if on disk
        already, or without a pool / snapshot)."""
        pool = self.state_snapshots
        if pool is None or block_hash not in pool:
            return False
        return self.disk.save_snapshot(block_hash, *pool.snapshot(block_hash))

    def load_snapshot(self, block_hash: bytes) -> bool:
        """Read ``block_hash``'s snapshot from disk into the pool (valid, ready for ``restore``);
        False on a miss (no file, a damaged one: deleted, or no pool slot free)."""
        pool = self.state_snapshots
        if pool is None:
            return False
        spec = pool.storage.spec
        state = self.disk.load_snapshot(block_hash, (spec.num_layers, *spec.conv_shape),
                                        (spec.num_layers, *spec.recurrent_shape), pool.storage.conv.dtype)
        return state is not None and pool.put(block_hash, *state)
