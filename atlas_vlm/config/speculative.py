"""``SpeculativeConfig``: exact speculative decoding (vLLM's ``SpeculativeConfig``;
atlas_vlm.spec_decode, docs/speculative.md).

Scope: validated on creation; the messages name the flat ``EngineConfig(...)`` keyword
(``speculative`` for ``method``, ``speculative_disable_by_batch_size`` for ``disable_by_batch_size``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas_vlm.config.checks import check_optional_positive, flat, is_int
from atlas_vlm.config.cli import flag

SPECULATIVE_METHODS = (None, "ngram", "mtp")  # atlas_vlm.spec_decode's proposers


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings.

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    method: str | None = field(default=None, metadata={**flat("speculative"), **flag(
        name="speculative", choices=SPECULATIVE_METHODS)})
    """Speculative decoding (docs/speculative.md): "ngram" (prompt-lookup drafts, vLLM's method="ngram")
    or "mtp" (a Qwen3.5 checkpoint's multi-token-prediction head); None: off. Distribution-exact
    always; token-for-token equal to speculation off only in fp32 or with deterministic (in bf16 a
    near-tie can part them: verification rows are other GEMM shapes)."""
    num_speculative_tokens: int | None = None
    """Drafts per decode step with speculation on (None: 4)."""
    prompt_lookup_max: int = 4
    """ngram: the longest n-gram looked up in the prompt (vLLM's prompt_lookup_max)."""
    prompt_lookup_min: int = 1
    """ngram: the shortest n-gram looked up (vLLM's prompt_lookup_min)."""
    disable_by_batch_size: int | None = field(default=2, metadata={**flat("speculative_disable_by_batch_size"), **flag(
        name="speculative-disable-by-batch-size")})
    """No drafts while more than this many requests run (None: draft at any batch size). Measured
    (scripts/bench.py --spec, SmolLM2, CPU): one stream 2.2-4.3x on copying tasks, but 4, 8 and 16
    requests ran at 0.8-0.92x with drafts: a batched step is no longer bound by reading the weights
    once, so verification rows cost compute."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        check_optional_positive("num_speculative_tokens", k, "tokens")
        if k is not None and self.method is None:
            raise ValueError("num_speculative_tokens is set but speculative is None (off); "
                             "pass speculative='ngram' or 'mtp' (--speculative ngram|mtp) to turn speculation on")
        check_optional_positive("speculative_disable_by_batch_size", self.disable_by_batch_size, "requests")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not is_int(lo) or lo < 1:
            raise ValueError(f"prompt_lookup_min must be an int >= 1 (tokens), got {lo!r}")
        if not is_int(hi) or hi < lo:
            raise ValueError(f"prompt_lookup_max must be an int >= prompt_lookup_min ({lo}), got {hi!r}")

    @property
    def speculative_tokens(self) -> int:
        """Drafts per decode step: 0 with speculation off, else ``num_speculative_tokens`` (4 if None)."""
        if self.method is None:
            return 0
        return 4 if self.num_speculative_tokens is None else self.num_speculative_tokens
