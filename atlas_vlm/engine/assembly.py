"""Engine assembly: load, measure, plan, build. The one place ``LLMEngine`` is put together.

Scope: ``probe_environment`` (the facts
the plan reads: device, dtype, the C decode kernel's and inductor's answers, the KV budget),
``build_runner`` (vision tower -> facts -> ``engine.plan.plan_engine`` -> ``ModelRunner``),
``build_proposer`` (the draft proposer) and ``build_engine_parts`` (block manager and
scheduler from the plan; ``LLMEngine.__init__`` and ``LLMEngine.reset`` both build through it).
What is built is decided by the plan alone; see docs/architecture.md, "The engine plan".
"""

from __future__ import annotations

from dataclasses import dataclass

from atlas_vlm.config import EngineConfig
from atlas_vlm.engine.plan import EnginePlan, plan_engine
from atlas_vlm.engine.plan_rules import Environment
from atlas_vlm.engine.scheduler import Scheduler
from atlas_vlm.loader import LoadedModel
from atlas_vlm.worker import runner_build
from atlas_vlm.worker.model_runner import ModelRunner, kv_cache_budget_bytes
from mm_kv_cache_management import BlockManager


def probe_environment(config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> Environment:
    """The facts ``plan_engine`` reads, measured once (after the vision tower is built, so that
    a CUDA budget sees its weights; an MTP head, built after the plan, is taken off by its
    checkpoint tensors' size): the C decode kernel is asked only where the attention backend
    may use it (``auto`` / ``decode_kernel`` / ``deterministic``)."""
    from atlas_vlm.kernels import decode_kernel
    from atlas_vlm.layers.attention import triton_unsupported_reason
    from atlas_vlm.layers.gguf_linear import GGUFLinear
    from atlas_vlm.layers.gguf_stored import GGUFDequantLinear
    from atlas_vlm.layers.quant_linear import quantized_modules
    from atlas_vlm.memory_plan import engine_max_pixels
    from atlas_vlm.worker.compiled_decode import resolve_compile_decode

    model, dev, kv_dtype = loaded.model, config.device_config, config.cache_config.kv_cache_dtype
    device, dtype, arch = next(model.parameters()).device, next(model.parameters()).dtype, model.arch
    why_not = decode_kernel.unsupported_reason(device, dtype, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                               kv_dtype) \
        if dev.attention_backend in ("auto", "decode_kernel") or dev.deterministic else None
    triton_why = "not probed"
    if dev.attention_backend == "triton" or (dev.attention_backend == "auto" and device.type == "cuda"):
        triton_why = triton_unsupported_reason(device, dtype, arch.head_dim, kv_dtype)
    budget = kv_cache_budget_bytes(config, device, loaded.hf_config, engine_max_pixels(config, loaded.image_settings))
    if device.type == "cuda" and config.speculative_config.method == "mtp" and model.mtp_state_dict:
        # the MTP head is built after the plan: its weights (model dtype) come off the measured budget now
        budget = max(0, budget - sum(t.numel() for t in model.mtp_state_dict.values()) * dtype.itemsize)
    if device.type == "cuda" and config.lora_config.enable_lora:  # the adapter slots, allocated after the plan
        budget = max(0, budget - runner_build.lora_slot_bytes(model, config.lora_config, dtype))
    quantized = bool(quantized_modules(model)) or any(isinstance(m, (GGUFLinear, GGUFDequantLinear))
                                                      for m in model.modules())  # a .gguf as stored counts too
    return Environment(device, dtype, arch, quantized=quantized, decode_kernel_reason=why_not,
                       triton_reason=triton_why,
                       compile_decode=resolve_compile_decode(dev.compile_decode, device, kv_dtype),
                       budget_bytes=budget, max_model_len=max_model_len)


def build_runner(config: EngineConfig, loaded: LoadedModel) -> tuple[EnginePlan, ModelRunner]:
    """(the plan, the ``ModelRunner`` built from it) for a loaded model.

    Raises:
        ValueError: a refused combination (``engine.plan_rules.RULES``).
        KVBudgetError: the budget holds no block, or not a hybrid model's state slots.
    """
    model = loaded.model
    max_model_len = config.model_config.max_model_len or min(model.arch.max_position_embeddings, 4096)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    vision = runner_build.load_vision_tower(loaded, dtype, device)  # before the budget: CUDA measures it
    caps = model.capabilities()
    plan = plan_engine(config, caps, probe_environment(config, loaded, max_model_len))
    return plan, ModelRunner(loaded, config, plan, vision)


def build_proposer(config: EngineConfig, runner: ModelRunner, hf_config):
    """The draft proposer of ``speculative_config.method`` (None: off); placeholder ids of the
    model's media are never drafted."""
    spec = config.speculative_config
    if spec.method is None:
        return None
    if spec.method == "mtp":  # drafts made by the runner's MTP head after each step
        return runner.drafter.proposer
    from atlas_vlm.spec_decode import NgramProposer, placeholder_token_ids

    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min, placeholder_token_ids(hf_config))


@dataclass(frozen=True)
class EngineServices:
    """What the block manager and scheduler share with the rest of the engine and keep across
    a reset: the disk KV tier (None without ``kv_cache_dir``), the structured-output manager
    and the draft proposer (None: no speculation)."""

    kv_tier: object
    structured_output_manager: object
    proposer: object


def build_engine_parts(plan: EnginePlan, runner: ModelRunner, services: EngineServices, eos_token_ids,
                       previous: Scheduler | None = None) -> tuple[BlockManager, Scheduler]:
    """A fresh ``BlockManager`` (no block held, no prefix-cache entry) and ``Scheduler`` (an
    empty encoder cache) as ``plan`` says, over the runner's KV cache and state. ``previous``:
    the scheduler they replace (``LLMEngine.reset``), whose running totals carry on."""
    block_manager = BlockManager(plan.num_blocks.value, plan.kv.block_size,
                                 enable_prefix_caching=plan.prefix_caching.value, kv_tier=services.kv_tier,
                                 state_cache=runner.state_cache, state_snapshots=runner.state_snapshots,
                                 drop_last_hit_block=plan.drop_last_hit_block)
    scheduler = Scheduler(block_manager, plan.scheduler, eos_token_ids=eos_token_ids,
                          structured_output_manager=services.structured_output_manager, proposer=services.proposer)
    if previous is not None:  # running totals (metrics)
        scheduler.num_preemptions, scheduler.spec_decode_stats = previous.num_preemptions, previous.spec_decode_stats
    return block_manager, scheduler
