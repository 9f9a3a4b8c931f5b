"""``CacheConfig``: the KV cache (vLLM's ``CacheConfig``): layout, storage dtype, block size,
memory, prefix caching, hybrid-state snapshots and the disk tier.

Scope: validated on creation (the messages name the flat ``EngineConfig(...)`` keyword,
e.g. ``kvcache_block_size`` for ``block_size``), and ``kv_cache_dir_kwargs`` for the CLIs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from atlas_vlm.config.checks import check_positive, flat
from atlas_vlm.config.cli import flag

KV_CACHE_KINDS = ("paged", "contiguous")
DEFAULT_KV_CACHE_DIR_MAX_BYTES = 10 << 30  # 10 GiB


@dataclass
class CacheConfig:
    """KV cache settings.

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    kv_cache: str = field(default="paged", metadata=flag(choices=KV_CACHE_KINDS))
    """"paged" (blocks) or "contiguous" (one max_model_len strip per request)."""
    kv_cache_dtype: str = field(default="auto", metadata=flag(choices=lambda: _kv_cache_dtypes()))
    """K/V storage: "auto" (the model dtype), "int8" or "fp8_e4m3" (8-bit codes with one scale per
    token and KV head, mm_kv_cache_management.kv_quant: ~1.9x the tokens in the same memory)."""
    block_size: int = field(default=16, metadata=flat("kvcache_block_size"))
    """Tokens per KV block."""
    num_kvcache_blocks: int = -1
    """KV blocks; -1: derived from memory (gpu_memory_utilization on CUDA, kv_cache_memory on CPU)."""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of device memory the engine may use."""
    kv_cache_memory: int = field(default=1 << 30, metadata=flag(bytes=True))
    """CPU: bytes reserved for K/V when num_kvcache_blocks is -1 (e.g. 512MiB)."""
    enable_prefix_caching: bool = True
    """Share computed full KV blocks between requests by content hash."""
    hybrid_snapshot_interval: int = 256
    """Hybrid models (Qwen3.5) under prefix caching: tokens between snapshots of the linear-attention
    state (a multiple of block_size); a prefix-cache hit resumes from the last snapshot."""
    max_state_snapshots: int = 16
    """Hybrid models (Qwen3.5) under prefix caching: state snapshots kept (each StateSpec.bytes_per_seq,
    ~20 MB for Qwen3.5-0.8B, off the KV budget; docs/kv-cache.md); 0: prefix caching off for them."""
    kv_cache_dir: str | None = field(default=None, metadata=flag(metavar="PATH"))
    """Disk tier below the prefix cache (mm_kv_cache_management/disk_tier.py): full KV blocks are
    written to this folder (under a model fingerprint) and found again, also after a restart; needs
    prefix caching and the paged cache. None: off."""
    kv_cache_dir_max_bytes: int = field(default=DEFAULT_KV_CACHE_DIR_MAX_BYTES, metadata=flag(
        name="kv-cache-dir-max-gb", type=float, default=None, metavar="X", convert=lambda gb: _gib_bytes(gb),
        requires="kv_cache_dir", help="On the command line in GiB (default 10)."))
    """Size cap of the disk tier in bytes, least recently used blocks out first."""

    def __post_init__(self) -> None:
        from mm_kv_cache_management.kv_quant import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)  # ValueError naming the known formats
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}")
        for name, value in (("kvcache_block_size", self.block_size), ("kv_cache_memory", self.kv_cache_memory)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.hybrid_snapshot_interval < 1:  # a multiple of the block size: checked with a hybrid model
            raise ValueError(f"hybrid_snapshot_interval must be >= 1 (tokens), got {self.hybrid_snapshot_interval}")
        if self.max_state_snapshots < 0:
            raise ValueError(f"max_state_snapshots must be >= 0 (0: no prefix caching for hybrid models), "
                             f"got {self.max_state_snapshots}")
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks must be -1 (auto) or >= 1, got {self.num_kvcache_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_kv_cache_dir()

    def _check_kv_cache_dir(self) -> None:
        check_positive("kv_cache_dir_max_bytes", self.kv_cache_dir_max_bytes, " (bytes)")
        if self.kv_cache_dir is None:
            return
        if not isinstance(self.kv_cache_dir, (str, os.PathLike)) or not str(self.kv_cache_dir):
            raise ValueError(f"kv_cache_dir must be a folder path or None, got {self.kv_cache_dir!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir (the disk KV tier) needs prefix caching on: drop "
                             "enable_prefix_caching=False / --no-enable-prefix-caching, or unset kv_cache_dir")
        if self.kv_cache != "paged":
            raise ValueError(f"kv_cache_dir (the disk KV tier) needs kv_cache='paged', got {self.kv_cache!r}")
        self.kv_cache_dir = os.fspath(self.kv_cache_dir)

    @property
    def prefix_caching(self) -> bool:
        """Prefix caching in effect: asked for and the cache is paged."""
        return self.enable_prefix_caching and self.kv_cache == "paged"


def _kv_cache_dtypes() -> tuple:
    from mm_kv_cache_management.kv_quant import KV_CACHE_DTYPES

    return KV_CACHE_DTYPES


def _gib_bytes(max_gb: float) -> int:
    """``--kv-cache-dir-max-gb X`` in bytes. Raises ValueError: X <= 0 (named)."""
    if not max_gb > 0:
        raise ValueError(f"--kv-cache-dir-max-gb must be > 0 (GiB), got {max_gb}")
    return max(1, int(max_gb * (1 << 30)))


def kv_cache_dir_kwargs(path: str | None, max_gb: float | None) -> dict:
    """``EngineConfig`` keywords of the CLIs' ``--kv-cache-dir PATH --kv-cache-dir-max-gb X``
    (X in GiB, 2**30 bytes; None: the default cap). Empty when ``path`` is None.

    Raises:
        ValueError: ``max_gb`` <= 0 or given without ``path`` (the message names the flag).
    """
    if path is None:
        if max_gb is not None:
            raise ValueError("--kv-cache-dir-max-gb needs --kv-cache-dir PATH")
        return {}
    if max_gb is None:
        return {"kv_cache_dir": path}
    return {"kv_cache_dir": path, "kv_cache_dir_max_bytes": _gib_bytes(max_gb)}
