"""The runner's pieces, built from the engine plan (``engine.plan.EnginePlan``).

Scope: one function per piece ``ModelRunner.__init__`` holds: the weights prepared for this
device (packed / tiled linears), the vision tower, the KV cache, the hybrid state slots and
snapshot pool, the MTP drafter, and the fast decode paths (compiled decode, the one-call C
step). Each reads the plan's decision and builds it; none decides anything (the plan did,
with its reason) and none asks the model for an optional attribute (its
``ModelCapabilities`` say what it has).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from atlas_vlm import hardware
from atlas_vlm.layers.batch_invariant import tile_linears
from atlas_vlm.layers.linear import can_pack, pack_linears
from mm_kv_cache_management import ContiguousKVCache, PagedKVCache, StateCache
from mm_kv_cache_management.state_snapshots import StateSnapshotPool

if TYPE_CHECKING:
    from atlas_vlm.engine.plan import EnginePlan

log = logging.getLogger(__name__)


def load_vision_tower(loaded, dtype: torch.dtype, device: torch.device):
    """The family's vision tower with the checkpoint's weights (None for a text-only model);
    built before the KV cache so that a CUDA budget sees its weights."""
    if loaded.vision_state_dict is None:
        return None
    from atlas_vlm.models.registry import import_named, resolve_family

    tower = import_named(resolve_family(loaded.hf_config).vision_tower)  # the family's tower class
    return tower.from_hf_config(loaded.hf_config, loaded.vision_state_dict, dtype=dtype, device=device)


def prepare_weights(model, vision, plan: EnginePlan) -> int:
    """Pack the linears for oneDNN where it pays (CPU bf16) and, with ``plan.deterministic``,
    tile them (``layers.batch_invariant``); returns the number of packed linears."""
    device, dtype = plan.device, plan.dtype
    if device.type == "cpu" and dtype == torch.bfloat16 and not hardware.cpu_features().fast_bf16:
        log.warning("bfloat16 on this CPU (%s) is emulated through fp32 and slower than float32; "
                    "dtype='auto' picks float32 here", hardware.cpu_features().describe())
    pack = can_pack(dtype, device)
    packed = (pack_linears(model) + (pack_linears(vision) if vision is not None else 0)) if pack else 0
    if plan.deterministic:  # fixed-row linears, every row through the C kernel
        tile_linears(model)
        if vision is not None:
            tile_linears(vision)
    return packed


def build_kv_cache(plan: EnginePlan):
    """The ``PagedKVCache`` (or ``ContiguousKVCache``) of ``plan.num_blocks`` blocks of ``plan.kv``."""
    kv = plan.kv
    if kv.kind == "contiguous":
        return ContiguousKVCache(kv.spec, plan.num_blocks.value, plan.max_model_len, device=plan.device)
    return PagedKVCache(kv.spec, plan.num_blocks.value, kv.block_size, device=plan.device)


def build_state(plan: EnginePlan, snapshot_interval: int) -> tuple[StateCache | None, StateSnapshotPool | None]:
    """A hybrid model's ``StateCache`` of ``plan.state_slots`` and its ``StateSnapshotPool``
    (``plan.state_snapshots``, every ``snapshot_interval`` tokens); (None, None) otherwise."""
    if plan.state_spec is None:
        return None, None
    state = StateCache(plan.state_spec, plan.state_slots, device=plan.device)
    snaps = plan.state_snapshots.value
    pool = StateSnapshotPool(plan.state_spec, snaps, snapshot_interval, plan.kv.block_size,
                             device=plan.device) if snaps else None
    return state, pool


def build_drafter(loaded, config, plan: EnginePlan):
    """(the MTP drafter, its packed linears) where ``plan.drafter`` is "mtp" (its layer reads
    and writes the cache layer after the model's own; packed as the model); (None, 0) otherwise.

    Raises:
        ValueError: the checkpoint lacks the MTP weights (``models.qwen3_5.mtp.build_mtp``).
    """
    if plan.drafter.value != "mtp":
        return None, 0
    from atlas_vlm.spec_decode import placeholder_token_ids
    from atlas_vlm.spec_decode.mtp import build_drafter as build_mtp_drafter

    kv_layer = dict(plan.kv.layer_groups)["attention"]
    drafter = build_mtp_drafter(loaded.model, config, kv_layer, str(config.model_config.model),
                                placeholder_token_ids(loaded.hf_config))
    return drafter, pack_linears(drafter.mtp) if can_pack(plan.dtype, plan.device) else 0


def lora_slot_bytes(model, lora_config, dtype: torch.dtype) -> int:
    """Bytes ``build_lora`` will allocate for ``lora_config``'s slots (``lora.manager.lora_memory_bytes``)."""
    from atlas_vlm.lora.manager import lora_memory_bytes, projection_shapes

    arch, sizes = model.arch, model.capabilities().qkv_sizes
    q, kv = (sizes[0], sizes[1]) if sizes else (arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim)
    shapes = projection_shapes(arch.hidden_size, q, kv, arch.intermediate_size)
    return lora_memory_bytes(shapes, arch.num_layers, lora_config.max_loras, lora_config.max_lora_rank,
                             dtype.itemsize)


def build_lora(model, plan: EnginePlan):
    """The ``LoRAModelManager`` wrapping the decoder's projections where ``plan.lora`` is on
    (after packing: it wraps whatever linear each projection is), else None."""
    if plan.lora.value is None:
        return None
    from atlas_vlm.lora.manager import LoRAModelManager

    max_loras, max_rank = plan.lora.value
    return LoRAModelManager(model, max_loras, max_rank, model.capabilities().qkv_sizes)


def build_decode_paths(model, kv_cache, plan: EnginePlan, max_num_seqs: int, mrope: bool):
    """(compiled decode or None, its reason, the one-call C decode step or None, its reason),
    as ``plan.compile_decode`` / ``plan.decode_step`` decided; the C step is built only
    where it serves this model (``DecodeStep.build`` says why not otherwise)."""
    compiled = None
    if plan.compile_decode.value:
        from atlas_vlm.worker.compiled_decode import CompiledDecode

        compiled = CompiledDecode(model, kv_cache, plan.kv.block_size, plan.max_model_len, max_num_seqs, mrope,
                                  use_kernel=plan.attention_backend.value == "decode_kernel")
    c_step, c_reason = None, plan.decode_step.reason
    if plan.decode_step.value:  # quantized models on CPU: decode-only steps through every layer in one C call
        from atlas_vlm.worker.decode_step import DecodeStep

        c_step, c_reason = DecodeStep.build(model, kv_cache, plan.attention_backend.value)
    return compiled, plan.compile_decode.reason, c_step, c_reason
