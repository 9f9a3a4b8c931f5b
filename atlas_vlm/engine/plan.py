"""The engine plan: what the engine is built from, decided once, each choice with its reason.

Scope: ``plan_engine(config, capabilities, env) -> EnginePlan``, a pure function (no model,
no device): it applies the exclusion table (``engine.plan_rules.RULES``), then decides the
attention backend, the KV spec (dtype, block size, layer groups), the number of blocks, the
state slots and snapshots, prefix caching, the drafter, the compiled decode and the one-call C
decode step, the step executors in order, the KV tier chain and pooling.
``engine.assembly`` builds the runner, block manager and scheduler from the plan.

To add a capability: one field on ``EnginePlan`` (a ``Choice`` with its reason), one branch
in the builder that reads it, one declared capability (``models.interfaces``); see
docs/architecture.md, "The engine plan".
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from atlas_vlm.config import EngineConfig
from atlas_vlm.engine.plan_rules import Environment, PlanContext, check_rules
from atlas_vlm.layers.attention import choose_attention_backend
from atlas_vlm.memory_plan import kv_cache_spec, num_kv_blocks
from atlas_vlm.models.interfaces import ModelCapabilities
from mm_kv_cache_management import KVCacheSpec, StateSpec

MTP_EAGER = "speculative='mtp': every step runs eager"
HYBRID_EAGER = "hybrid model (recurrent-state layers)"
LORA_EAGER = "enable_lora=True: every step runs eager (the adapters' products per group of rows)"


class KVBudgetError(ValueError):
    """The KV memory budget cannot hold a single block."""


@dataclass(frozen=True)
class Choice:
    """One decision of the plan and why it was taken."""

    value: Any
    reason: str


@dataclass(frozen=True)
class KVPlan:
    """The KV cache: ``kind`` "paged" / "contiguous", ``block_size`` tokens per block (a
    contiguous cache: ``max_model_len``), ``layer_groups`` ((name, layers), in cache-layer
    order: the model's attention layers, then the MTP head's), ``spec`` one token's shape."""

    kind: str
    block_size: int
    layer_groups: tuple[tuple[str, int], ...]
    spec: KVCacheSpec


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler's numbers (``engine.scheduler.Scheduler``'s settings).

    Attributes:
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens computed per step at most (the plan: without chunked
            prefill at least ``max_model_len``).
        enable_chunked_prefill: a prompt may be split across steps; if off, a prompt is
            computed in one step (alone if it is longer than the budget).
        max_model_len: tokens per request (None: no limit here; the engine checks at entry).
        max_num_encoder_tokens: encoder rows (image / video tokens) computed per step at most;
            None: no limit.
        encoder_cache_tokens: rows the scheduler's ``EncoderCacheManager`` keeps.
        num_speculative_tokens: drafts per decode step at most (with a proposer).
        speculative_disable_by_batch_size: no drafts while more requests than this run (None: any).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    max_num_encoder_tokens: int | None = None
    encoder_cache_tokens: int = 0
    num_speculative_tokens: int = 0
    speculative_disable_by_batch_size: int | None = None


@dataclass(frozen=True)
class EnginePlan:
    """What the engine is built from (``plan_engine``); ``reasons`` says why for each ``Choice``."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    deterministic: bool
    attention_backend: Choice
    kv: KVPlan
    num_blocks: Choice
    state_spec: StateSpec | None
    state_slots: int
    state_snapshots: Choice
    prefix_caching: Choice
    drafter: Choice
    drop_last_hit_block: bool
    compile_decode: Choice
    decode_step: Choice
    executors: tuple[str, ...]
    kv_tiers: tuple[str, ...]
    pooling: Choice
    scheduler: SchedulerLimits
    lora: Choice = Choice(None, "enable_lora=False")  # (max_loras, max_lora_rank) or None

    @property
    def reasons(self) -> dict[str, str]:
        """Field name -> the reason of that choice."""
        return {f.name: getattr(self, f.name).reason for f in fields(self)
                if isinstance(getattr(self, f.name), Choice)}


def _attention_backend(config: EngineConfig, env: Environment) -> Choice:
    requested = config.device_config.attention_backend
    if config.device_config.deterministic:
        return Choice("batch_invariant", "deterministic=True: every row through the C decode kernel, fixed tiles")
    return Choice(*choose_attention_backend(requested, env.device.type, env.triton_reason, env.decode_kernel_reason))


def _sizes(config: EngineConfig, ctx: PlanContext, spec: KVCacheSpec, block_size: int,
           snaps: int) -> tuple[int, int, int]:
    """(num_blocks, state_slots, state_bytes) under the budget: a hybrid model's state slots
    (``max_num_seqs`` + ``snaps``) first, KV blocks from the rest.

    Raises:
        KVBudgetError: the budget holds no block (or, contiguous, no strip), or not the state slots.
    """
    cache, max_num_seqs, budget = config.cache_config, config.scheduler_config.max_num_seqs, ctx.env.budget_bytes
    state_slots = max_num_seqs if ctx.caps.hybrid else 0
    state_bytes = ctx.caps.state_spec.bytes_per_seq * (max_num_seqs + snaps) if ctx.caps.hybrid else 0
    if state_bytes > budget and cache.num_kvcache_blocks == -1:  # explicit blocks: no budget to share
        pool = f" + max_state_snapshots={snaps}" if snaps else ""
        raise KVBudgetError(
            f"KV budget of {budget} bytes cannot hold the state slots of this hybrid model: "
            f"max_num_seqs={max_num_seqs}{pool} x {ctx.caps.state_spec.bytes_per_seq} bytes = {state_bytes} "
            "bytes; raise kv_cache_memory / gpu_memory_utilization or lower max_num_seqs"
            + (" / max_state_snapshots" if snaps else ""))
    budget -= state_bytes
    num_blocks = cache.num_kvcache_blocks
    if num_blocks == -1:
        num_blocks = num_kv_blocks(budget, spec, block_size)
    if num_blocks < 1:
        contiguous = cache.kv_cache == "contiguous"
        unit = "strip" if contiguous else "block"
        after = f" (after {state_bytes} bytes of state slots)" if state_bytes else ""
        raise KVBudgetError(
            f"KV budget of {budget} bytes{after} is too small for one {unit} of {block_size} tokens "
            f"({spec.bytes_per_token * block_size} bytes); raise kv_cache_memory / "
            f"gpu_memory_utilization or lower {'max_model_len' if contiguous else 'kvcache_block_size'}")
    return num_blocks, state_slots, state_bytes


def _decode_paths(ctx: PlanContext) -> tuple[Choice, Choice]:
    """(compiled decode, one-call C decode step): each on, or off with why."""
    compiled = Choice(*ctx.env.compile_decode)
    c_step = Choice(True, "CPU: tried (kernels.decode_step.DecodeStep.build decides)") \
        if ctx.env.device.type == "cpu" else Choice(False, "CPU only")
    if ctx.caps.hybrid:  # the fast decode paths carry no state slots: eager runs hybrids
        compiled = Choice(False, f"{HYBRID_EAGER}: decode runs eager")
        c_step = Choice(False, HYBRID_EAGER)
    if ctx.method == "mtp":  # the drafter reads every step's hidden states: eager keeps them
        compiled, c_step = Choice(False, MTP_EAGER), Choice(False, MTP_EAGER)
    if ctx.config.lora_config.enable_lora:  # the fast paths read the base weights only: adapters run eager
        compiled, c_step = Choice(False, LORA_EAGER), Choice(False, LORA_EAGER)
    return compiled, c_step


def plan_engine(config: EngineConfig, capabilities: ModelCapabilities, env: Environment) -> EnginePlan:
    """Decide what the engine is built from. Pure: reads its arguments only.

    Raises:
        ValueError: a refused combination (the first row of ``plan_rules.RULES`` that holds).
        KVBudgetError: the budget holds no block, or not a hybrid model's state slots.
    """
    ctx = PlanContext(config, capabilities, env)
    check_rules(ctx)
    cache, sched, spec_config, arch = (config.cache_config, config.scheduler_config, config.speculative_config,
                                       env.arch)
    mtp = spec_config.method == "mtp"
    groups = (("attention", capabilities.num_kv_layers),) + ((("mtp", 1),) if mtp else ())
    spec = kv_cache_spec(sum(n for _, n in groups), arch.num_kv_heads, arch.head_dim, env.dtype, cache.kv_cache_dtype)
    contiguous = cache.kv_cache == "contiguous"
    block_size = env.max_model_len if contiguous else cache.block_size
    snaps = ctx.num_state_snapshots if capabilities.hybrid else 0
    num_blocks, state_slots, state_bytes = _sizes(config, ctx, spec, block_size, snaps)
    prefix = Choice(cache.prefix_caching, "enable_prefix_caching" if cache.prefix_caching else
                    "enable_prefix_caching=False or a contiguous cache")
    if capabilities.hybrid:
        prefix = Choice(snaps > 0, "hybrid model: served by state snapshots" if snaps else
                        "hybrid model without state snapshots: a hit would skip tokens whose recurrent state is "
                        "not stored")
    compiled, c_step = _decode_paths(ctx)
    budget = sched.max_num_batched_tokens if sched.enable_chunked_prefill else \
        max(sched.max_num_batched_tokens, env.max_model_len)
    return EnginePlan(
        device=env.device, dtype=env.dtype, max_model_len=env.max_model_len,
        deterministic=config.device_config.deterministic, attention_backend=_attention_backend(config, env),
        kv=KVPlan("contiguous" if contiguous else "paged", block_size, groups, spec),
        num_blocks=Choice(num_blocks, "num_kvcache_blocks" if cache.num_kvcache_blocks != -1 else
                          f"{env.budget_bytes} bytes of budget{f' - {state_bytes} of state' if state_bytes else ''}"),
        state_spec=capabilities.state_spec, state_slots=state_slots,
        state_snapshots=Choice(snaps, "max_state_snapshots (hybrid model, prefix caching)" if snaps else
                               "no snapshot pool"),
        prefix_caching=prefix,
        drafter=Choice(spec_config.method, f"speculative={spec_config.method!r}"),
        drop_last_hit_block=mtp, compile_decode=compiled, decode_step=c_step,
        executors=(("compiled",) if compiled.value else ()) + (("decode_step",) if c_step.value else ()) + ("eager",),
        kv_tiers=("memory", "disk") if cache.kv_cache_dir is not None else ("memory",),
        pooling=Choice(capabilities.pooling, "the eager executor keeps the final hidden states for pooling steps"),
        scheduler=SchedulerLimits(sched.max_num_seqs, budget, sched.enable_chunked_prefill, env.max_model_len,
                                  sched.max_num_encoder_tokens or budget, sched.encoder_cache_tokens,
                                  spec_config.speculative_tokens, spec_config.disable_by_batch_size),
        lora=_lora_choice(config))


def _lora_choice(config: EngineConfig) -> Choice:
    """(max_loras, max_lora_rank) with LoRA on (its slot memory comes off the budget in
    ``engine.assembly.probe_environment``), else None."""
    lora = config.lora_config
    if not lora.enable_lora:
        return Choice(None, "enable_lora=False")
    return Choice((lora.max_loras, lora.max_lora_rank),
                  f"enable_lora: {lora.max_loras} slots of rank {lora.max_lora_rank}")
