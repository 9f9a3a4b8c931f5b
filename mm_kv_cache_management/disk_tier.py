"""A disk tier under the in-memory prefix cache: full KV blocks as files, found again by hash.

Layout: ``<root>/<fingerprint>/<block hash hex>.kvb``, one file per block, holding that
block's K and V for every layer; a hybrid model's state snapshot at that block's end (conv +
recurrent state of every linear-attention layer, ``state_snapshots.py``) goes beside it as
``<block hash hex>.kvs`` (``save_snapshot`` / ``load_snapshot``: same header, checksum,
atomic write, byte cap and LRU as a block). ``fingerprint`` (``atlas_vlm.worker.kv_tier_builder``)
hashes everything that changes K/V (weights identity, dtypes, shapes, RoPE, ...), so a directory
shared by several models or settings never serves one model's K/V to another.

File: ``MAGIC``, a 4-byte little-endian header length, a JSON header (format version,
fingerprint, block hash, shape, dtype, blake2b of the payload), then the payload (K then V,
raw bytes). A file that is truncated, corrupt or from another fingerprint / shape is a miss:
it is deleted and the first such case is logged (once per tier).

Writes are atomic (``atomic_files.write_atomic``: a locked temporary ``.tmp-*.part`` in the same
folder, fsync, ``os.replace``), so processes sharing the folder never read a half-written block;
the temporaries a killed writer left (SIGKILL mid-write) are deleted when a tier opens ``root``
(their lock is free; a live writer's is held). The tier holds at most ``max_bytes`` (summed over
every fingerprint folder of ``root``): past it the least recently used files (by mtime, which a
hit refreshes) are deleted, down to ``EVICT_TO`` of the cap. An ``OSError`` while creating the
folder or writing (read-only folder, full disk) turns writing off with one warning; reads go on
and no request fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import time
from pathlib import Path

import torch

from mm_kv_cache_management.atomic_files import remove_dead_temporaries, write_atomic

log = logging.getLogger(__name__)

MAGIC = b"ATLASKV1"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
SNAPSHOT_SUFFIX = ".kvs"  # a hybrid model's state snapshot at the end of the block of that hash
SUFFIXES = (SUFFIX, SNAPSHOT_SUFFIX)
EVICT_TO = 0.9  # eviction goes down to this fraction of max_bytes
TMP_PREFIX = ".tmp-"  # files being written (then renamed to <hash>.kvb)
STALE_TMP_S = 3600  # without file locks (not POSIX): a temporary this old (seconds) was left by a dead writer


class DiskKVTier:
    """Blocks of K/V on disk, keyed by their chained block hash.

    Args:
        root: the ``kv_cache_dir`` (created if missing).
        fingerprint: hex string naming this engine's K/V (its subfolder of ``root``).
        max_bytes: size cap of all ``*.kvb`` and ``*.kvs`` files under ``root`` (bytes, >= 1).

    Raises:
        ValueError: ``max_bytes`` < 1 or an empty ``fingerprint``.
    """

    def __init__(self, root: str | os.PathLike, fingerprint: str, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"kv_cache_dir_max_bytes must be an int >= 1 (bytes), got {max_bytes!r}")
        if not fingerprint:
            raise ValueError("the disk KV tier needs a non-empty fingerprint")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir = self.root / fingerprint
        self.max_bytes = max_bytes
        self.writable = True
        self.hits = 0  # blocks found and loaded
        self.misses = 0  # lookups that found no valid file
        self._warned_corrupt = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disable_writes(e)
        self._index: dict[Path, tuple[int, int]] = {}  # every *.kvb / *.kvs under root -> (bytes, mtime ns)
        self._total = 0  # bytes in _index
        self._rescan()
        self._remove_stale_temporaries()

    # ---- bookkeeping ------------------------------------------------------------------
    def _disable_writes(self, err: OSError) -> None:
        if self.writable:
            log.warning("disk KV tier %s is not writable (%s); going on without writing to it", self.dir, err)
        self.writable = False

    def _rescan(self) -> None:
        """Refresh the index from disk (other processes may have added or deleted files)."""
        index = {}
        for path in self.root.glob("*/*.kv?") if self.root.is_dir() else ():
            if path.suffix not in SUFFIXES or path.name.startswith(TMP_PREFIX):
                continue
            try:
                st = path.stat()
            except OSError:  # deleted meanwhile
                continue
            index[path] = (st.st_size, st.st_mtime_ns)
        self._index = index
        self._total = sum(size for size, _ in index.values())

    def _remove_stale_temporaries(self) -> None:
        """Delete the temporaries a writer that died left in any fingerprint folder of ``root``
        (``atomic_files.remove_dead_temporaries``: lock free, so no live process writes them)."""
        folders = [p for p in self.root.iterdir() if p.is_dir()] if self.root.is_dir() else []
        removed = remove_dead_temporaries(folders, TMP_PREFIX, STALE_TMP_S)
        if removed:
            log.info("disk KV tier: removed %d temporary file(s) a killed writer left under %s", removed, self.root)

    def _forget(self, path: Path) -> None:
        size, _ = self._index.pop(path, (0, 0))
        self._total -= size

    @property
    def bytes_stored(self) -> int:
        """Bytes of block files under ``root`` as last seen by this process."""
        return self._total

    def path(self, block_hash: bytes, suffix: str = SUFFIX) -> Path:
        """The file of ``block_hash`` in this fingerprint's folder (``suffix``: ``SUFFIX`` for its
        K/V, ``SNAPSHOT_SUFFIX`` for its state snapshot)."""
        return self.dir / (block_hash.hex() + suffix)

    def contains(self, block_hash: bytes, suffix: str = SUFFIX) -> bool:
        """Whether a file exists for ``block_hash`` (not yet checked: ``load`` verifies)."""
        return self.path(block_hash, suffix).is_file()

    def _evict(self) -> None:
        """Past ``max_bytes``: delete least recently used files down to ``EVICT_TO`` of the cap
        (the slack spares a folder scan per write once the cap is reached)."""
        self._rescan()
        if self._total <= self.max_bytes:
            return
        for path, _ in sorted(self._index.items(), key=lambda item: item[1][1]):
            if self._total <= self.max_bytes * EVICT_TO:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                self._disable_writes(e)
                return
            self._forget(path)

    # ---- blocks -----------------------------------------------------------------------
    def save(self, block_hash: bytes, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Store one block's K and V (each ``[num_layers, block_size, num_kv_heads, head_dim]``)
        atomically; a no-op if its file exists. Returns whether a file was written; never
        raises ``OSError`` (writing turns off instead)."""
        return self._write(block_hash, SUFFIX, (k, v), list(k.shape))

    def save_snapshot(self, block_hash: bytes, conv: torch.Tensor, recurrent: torch.Tensor) -> bool:
        """Store the state snapshot at the end of ``block_hash``'s block (``conv`` ``[num_layers,
        conv_dim, kernel - 1]``, ``recurrent`` ``[num_layers, v_heads, k_head_dim, v_head_dim]``,
        one dtype) as ``<hash>.kvs``; as ``save`` otherwise."""
        return self._write(block_hash, SNAPSHOT_SUFFIX, (conv, recurrent), [list(conv.shape), list(recurrent.shape)])

    def _write(self, block_hash: bytes, suffix: str, tensors, shape_meta) -> bool:
        """Write ``tensors`` (one dtype) back to back as ``<hash><suffix>``, atomically."""
        target = self.path(block_hash, suffix)
        if not self.writable or target.exists():
            return False
        payload = b"".join(_tensor_bytes(t) for t in tensors)
        header = json.dumps({
            "version": FORMAT_VERSION, "fingerprint": self.fingerprint, "block_hash": block_hash.hex(),
            "shape": shape_meta, "dtype": str(tensors[0].dtype).removeprefix("torch."),
            "blake2b": hashlib.blake2b(payload).hexdigest(),
        }).encode()
        try:
            if not write_atomic(target, MAGIC + struct.pack("<I", len(header)) + header + payload, TMP_PREFIX):
                return False  # our temporary was taken for a dead writer's: not written, nothing lost
        except OSError as e:
            self._disable_writes(e)
            return False
        self._forget(target)  # (a file another process wrote since the last scan)
        self._index[target] = (len(MAGIC) + 4 + len(header) + len(payload), time.time_ns())
        self._total += self._index[target][0]
        if self._total > self.max_bytes:
            self._evict()
        return True

    def load(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of ``block_hash`` (CPU tensors of ``shape`` / ``dtype``), or None on a miss.
        A file that does not match (corrupt, truncated, other fingerprint, shape or dtype) is
        deleted and counts as a miss."""
        shape = tuple(shape)
        return self._read(block_hash, SUFFIX, (shape, shape), list(shape), dtype)

    def load_snapshot(self, block_hash: bytes, conv_shape: tuple[int, ...], recurrent_shape: tuple[int, ...],
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(conv, recurrent)`` of ``block_hash``'s state snapshot (CPU tensors of these shapes),
        or None on a miss; a file that does not match is deleted, as in ``load``."""
        shapes = (tuple(conv_shape), tuple(recurrent_shape))
        return self._read(block_hash, SNAPSHOT_SUFFIX, shapes, [list(s) for s in shapes], dtype)

    def _read(self, block_hash: bytes, suffix: str, shapes, shape_meta, dtype: torch.dtype):
        """The tensors of ``<hash><suffix>`` (``shapes``), or None on a miss (see ``load``)."""
        path = self.path(block_hash, suffix)
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        tensors = self._parse(data, block_hash, shapes, shape_meta, dtype)
        if tensors is None:
            self.misses += 1
            if not self._warned_corrupt:
                log.warning("disk KV tier: %s is corrupt or does not match this engine; deleted it "
                            "(further such files are deleted silently)", path)
                self._warned_corrupt = True
            try:
                path.unlink()
            except OSError:
                pass
            self._forget(path)
            return None
        self.hits += 1
        try:
            os.utime(path)  # LRU: a hit makes the file young
        except OSError:
            pass
        return tensors

    def _parse(self, data: bytes, block_hash: bytes, shapes, shape_meta, dtype: torch.dtype):
        head = len(MAGIC) + 4
        if len(data) < head or not data.startswith(MAGIC):
            return None
        (n,) = struct.unpack("<I", data[len(MAGIC):head])
        try:
            meta = json.loads(data[head:head + n])
        except ValueError:
            return None
        payload = data[head + n:]
        elem = torch.empty((), dtype=dtype).element_size()
        sizes = [math.prod(shape) for shape in shapes]  # elements of each tensor
        if not isinstance(meta, dict) or (
                meta.get("version"), meta.get("fingerprint"), meta.get("block_hash"), meta.get("shape"),
                meta.get("dtype")) != (FORMAT_VERSION, self.fingerprint, block_hash.hex(), shape_meta,
                                       str(dtype).removeprefix("torch.")):
            return None
        if len(payload) != sum(sizes) * elem or hashlib.blake2b(payload).hexdigest() != meta.get("blake2b"):
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype)
        out, start = [], 0
        for shape, numel in zip(shapes, sizes):
            out.append(flat[start:start + numel].view(shape))
            start += numel
        return tuple(out)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of ``t`` (any dtype, bf16 included), C order, from any device."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
