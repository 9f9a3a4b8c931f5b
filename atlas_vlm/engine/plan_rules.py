"""The exclusion table: which engine options cannot run together, or not with this model.

Options that conflict within one sub-config are refused when it is built (``atlas_vlm.config``);
this table holds the rest: options against each other across sub-configs, against the model's
capabilities and against this machine.

Scope: ``PlanContext`` (what a rule sees: the ``EngineConfig``, the model's declared
``ModelCapabilities`` and the ``Environment`` facts measured once), ``Rule`` (one row: a name,
a predicate and the message users get) and ``RULES``, in the order they are checked (the
first row that holds refuses the configuration). ``engine.plan.plan_engine`` applies it before
it decides anything; nothing else refuses a combination of options. Pure: no model, no device.

To refuse a new combination, add one row here (and one case to tests/engine/test_assembly.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from atlas_vlm.config import EngineConfig
from atlas_vlm.layers.batch_invariant import deterministic_unsupported_reason
from atlas_vlm.models.arch import ModelArch
from atlas_vlm.models.interfaces import ModelCapabilities

# drafters tested on hybrid models (their recurrent state rolls back by accepted counts alone,
# whatever the drafter: ``StateCache.accept_rows``); add one here once its hybrid runs are tested
HYBRID_SPECULATIVE = ("ngram", "mtp")


@dataclass(frozen=True)
class Environment:
    """Facts of this machine and the loaded weights the plan reads, measured once
    (``engine.assembly.probe_environment``); a test writes them by hand.

    Attributes:
        device, dtype: where and in what the model runs.
        arch: the decoder's hyper-parameters (heads, head size, layers).
        quantized: the model has quantized linears.
        decode_kernel_reason: why the C decode kernel cannot serve this model with the
            configured ``kv_cache_dtype`` (``kernels.decode_kernel.unsupported_reason``); None: it can.
        triton_reason: why the Triton attention kernel cannot serve this model (Triton does
            not import, or ``kernels.triton_attention.unsupported_reason``); None: it can. Probed
            only where the backend may be Triton (``"triton"`` asked for, or ``"auto"`` on CUDA).
        compile_decode: ``worker.compiled_decode.resolve_compile_decode`` for the configured
            ``compile_decode``: (on, why).
        budget_bytes: bytes the KV cache (and a hybrid model's state) may take.
        max_model_len: resolved tokens per request.
    """

    device: torch.device
    dtype: torch.dtype
    arch: ModelArch
    quantized: bool = False
    decode_kernel_reason: str | None = None
    triton_reason: str | None = "not probed"
    compile_decode: tuple[bool, str] = (False, "compile_decode=False")
    budget_bytes: int = 1 << 30
    max_model_len: int = 4096


@dataclass(frozen=True)
class PlanContext:
    """What a rule's predicate and message see."""

    config: EngineConfig
    caps: ModelCapabilities
    env: Environment

    @property
    def method(self) -> str | None:
        """``speculative_config.method`` (None: no speculative decoding)."""
        return self.config.speculative_config.method

    @property
    def num_state_snapshots(self) -> int:
        """Snapshots a hybrid model's pool holds: ``max_state_snapshots`` where prefix caching
        is asked for and the model class writes snapshots, else 0 (no pool)."""
        cache = self.config.cache_config
        return cache.max_state_snapshots if cache.prefix_caching and self.caps.state_snapshots else 0

    @property
    def deterministic_reason(self) -> str | None:
        """Why ``deterministic=True`` cannot run with these settings (None: it can)."""
        dev = self.config.device_config
        return deterministic_unsupported_reason(self.env.device, self.env.quantized, dev.attention_backend,
                                                dev.compile_decode)

    def fields(self) -> dict:
        """The names a rule's message may use."""
        return {"model_class": self.caps.model_class, "model_name": str(self.config.model_config.model),
                "method": self.method, "decode_kernel_why": self.env.decode_kernel_reason,
                "triton_why": self.env.triton_reason,
                "deterministic_why": self.deterministic_reason, "hybrid_speculative": HYBRID_SPECULATIVE}


@dataclass(frozen=True)
class Rule:
    """One row of the table: ``when(ctx)`` holds -> ``error(message.format(**ctx.fields()))``."""

    name: str
    when: Callable[[PlanContext], bool]
    message: str
    error: type[Exception] = ValueError

    def refusal(self, ctx: PlanContext) -> Exception | None:
        """The error this row raises for ``ctx`` (None: the row does not hold)."""
        return self.error(self.message.format(**ctx.fields())) if self.when(ctx) else None


def _dev(ctx: PlanContext):
    return ctx.config.device_config


def _lora(ctx: PlanContext) -> bool:
    return ctx.config.lora_config.enable_lora


RULES: tuple[Rule, ...] = (
    Rule("decode_kernel_cannot_serve",
         lambda c: _dev(c).attention_backend == "decode_kernel" and c.env.decode_kernel_reason is not None,
         "attention_backend='decode_kernel' cannot serve this model: {decode_kernel_why}"),
    Rule("triton_cannot_serve",
         lambda c: _dev(c).attention_backend == "triton" and c.env.triton_reason is not None,
         "attention_backend='triton' cannot serve this model: {triton_why}"),
    Rule("deterministic_hybrid", lambda c: _dev(c).deterministic and c.caps.hybrid,
         "deterministic=True does not serve hybrid models ({model_class}: recurrent-state layers); "
         "run it with deterministic=False"),
    Rule("deterministic_settings", lambda c: _dev(c).deterministic and c.deterministic_reason is not None,
         "deterministic=True cannot run here: {deterministic_why}"),
    Rule("deterministic_decode_kernel", lambda c: _dev(c).deterministic and c.env.decode_kernel_reason is not None,
         "deterministic=True cannot run here: {decode_kernel_why}"),
    Rule("mtp_without_head", lambda c: c.method == "mtp" and not c.caps.mtp,
         "speculative='mtp' needs a model with a multi-token-prediction head (Qwen3.5's mtp.*); "
         "{model_name} ({model_class}) has none; use speculative='ngram'"),
    Rule("speculative_hybrid_no_rollback",
         lambda c: c.method is not None and c.caps.hybrid and not c.caps.state_rollback,
         "speculative={method!r} cannot run {model_class}, a hybrid model: its recurrent state cannot roll back "
         "rejected drafts; pass speculative=None"),
    Rule("speculative_hybrid_untested",
         lambda c: c.method is not None and c.caps.hybrid and c.method not in HYBRID_SPECULATIVE,
         "speculative={method!r} is not tested on hybrid models such as {model_class} yet; "
         "pass one of {hybrid_speculative} or None"),
    Rule("kv_cache_dir_hybrid_without_snapshots",
         lambda c: c.caps.hybrid and c.num_state_snapshots == 0 and c.config.cache_config.kv_cache_dir is not None,
         "kv_cache_dir needs prefix caching, which {model_class}, a hybrid model, only has with state snapshots: "
         "set max_state_snapshots >= 1, or unset kv_cache_dir"),
    Rule("lora_unsupported_model", lambda c: _lora(c) and not c.caps.lora,
         "enable_lora=True cannot serve {model_class} yet (its layers lack the q/k/v/o/gate/up/down projections "
         "LoRA wraps: a hybrid model's linear-attention layers); run it with enable_lora=False"),
    Rule("lora_deterministic", lambda c: _lora(c) and _dev(c).deterministic,
         "enable_lora=True cannot run with deterministic=True (the adapters' grouped products are not "
         "batch-invariant); pass one of them"),
    Rule("lora_mtp", lambda c: _lora(c) and c.method == "mtp",
         "enable_lora=True cannot run with speculative='mtp' (the MTP head has no adapter); use "
         "speculative='ngram' or None"),
    Rule("kv_cache_dir_mtp", lambda c: c.method == "mtp" and c.config.cache_config.kv_cache_dir is not None,
         "kv_cache_dir cannot serve speculative='mtp' (a disk hit's last block holds MTP K/V made with another "
         "request's next token); unset kv_cache_dir or use speculative='ngram'"),
)


def check_rules(ctx: PlanContext, rules: tuple[Rule, ...] = RULES) -> None:
    """Raise the first refusal of ``rules`` (in order) that holds for ``ctx``.

    Raises:
        ValueError: the row's message (see ``RULES``).
    """
    for rule in rules:
        error = rule.refusal(ctx)
        if error is not None:
            raise error
