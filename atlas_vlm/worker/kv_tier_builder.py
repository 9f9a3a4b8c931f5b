"""Builds the disk KV tier of an engine from ``EngineConfig``, in the folder its fingerprint names.

A block's file is only valid for an engine whose K/V for the same tokens are bit-identical,
so the tier's folder (``kv_cache_dir/<fingerprint>/``) is named by a hash of everything that
changes K/V: the weights' identity (the loaded folder's resolved path and every file's name,
size and mtime, so a re-converted or edited checkpoint gets a new folder), the model and KV
dtypes, the quantization, block size, layers / KV heads / head_dim, the RoPE settings
(``rope_theta``, ``rope_scaling``, M-RoPE sections), the device type and attention backend
(float results differ across them), ``ENGINE_FORMAT_VERSION`` (bump it when the K/V an
engine computes for given weights changes) and, with an 8-bit ``kv_cache_dtype`` only,
``kv_quant.KV_FORMAT`` (how codes and scales encode K/V), so a file of an older 8-bit format is
never read as the new one while ``auto`` caches keep their folder. For a hybrid model (a
``StateCache``) it also covers the state snapshots written beside the blocks: the state's
layout (linear-attention layers, conv / recurrent shapes) and dtype; the Gated DeltaNet
weights that make the state are in the weights' identity with every other tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from mm_kv_cache_management import DiskKVTier, KVBlockTier
from mm_kv_cache_management.kv_quant import KV_FORMAT

log = logging.getLogger(__name__)

ENGINE_FORMAT_VERSION = 1


def _weights_identity(model_dir: Path) -> list:
    """``[resolved path, [name, size, mtime_ns] per file]`` of the loaded checkpoint."""
    root = Path(model_dir).resolve()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    rows = []
    for p in files:
        st = p.stat()
        rows.append([str(p.relative_to(root)) if p != root else p.name, st.st_size, st.st_mtime_ns])
    return [str(root), rows]


def _rope_settings(hf_config) -> dict:
    text = getattr(hf_config, "text_config", None) or hf_config
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor")
    return {k: getattr(text, k, None) for k in keys}


def engine_fingerprint(model_dir: Path, hf_config, runner, quantization: str | None) -> str:
    """Hex blake2b (32 hex chars) of what changes this engine's K/V (module docstring).

    Args:
        model_dir: the folder (or file) the weights were loaded from (``LoadedModel.model_dir``).
        hf_config: the transformers config (RoPE settings).
        runner: the ``ModelRunner`` (dtype, device, block size, KV spec, attention backend).
        quantization: ``EngineConfig.quantization``.
    """
    spec = runner.kv_cache.spec
    arch = runner.model.arch
    facts = {
        "engine_format": ENGINE_FORMAT_VERSION,
        "weights": _weights_identity(model_dir),
        "model_dtype": str(runner.dtype), "kv_dtype": str(spec.dtype),
        "kv_cache_dtype": spec.kv_cache_dtype, "quantization": quantization,
        "block_size": runner.block_size, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "rope": _rope_settings(hf_config),
        "mrope_section": list(arch.mrope_section) if arch.mrope_section is not None else None,
        "device": runner.device.type, "attention_backend": runner.attention_backend,
    }
    if spec.quantized:  # auto KV: the key is absent, so its fingerprint is what it was
        facts["kv_format"] = KV_FORMAT
    state = getattr(runner, "state_cache", None)
    if state is not None:  # hybrid: the snapshots' layout (only then, so other folders keep their names)
        state_spec = state.spec
        facts["state"] = {"num_layers": state_spec.num_layers, "conv": list(state_spec.conv_shape),
                          "recurrent": list(state_spec.recurrent_shape), "dtype": str(state.conv.dtype)}
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def build_kv_tier(config, model_dir: Path, hf_config, runner) -> KVBlockTier | None:
    """The engine's ``KVBlockTier`` over ``config.cache_config.kv_cache_dir`` (None when it is
    unset). An unusable folder does not fail: ``DiskKVTier`` warns once and stops writing."""
    cache = config.cache_config
    if cache.kv_cache_dir is None:
        return None
    fingerprint = engine_fingerprint(model_dir, hf_config, runner, config.model_config.quantization)
    disk = DiskKVTier(cache.kv_cache_dir, fingerprint, cache.kv_cache_dir_max_bytes)
    log.info("disk KV tier: %s (cap %d bytes)", disk.dir, disk.max_bytes)
    return KVBlockTier(runner.kv_cache, disk, getattr(runner, "state_snapshots", None))
