"""``SchedulerConfig``: what one engine step may hold (vLLM's ``SchedulerConfig``): running
requests, the step's token budget, chunked prefill, and the media encoder's cache and budget.

Scope: validated on creation; the messages name the flat ``EngineConfig(...)`` keyword.
"""

from __future__ import annotations

from dataclasses import dataclass

from atlas_vlm.config.checks import check_optional_positive, is_int


@dataclass
class SchedulerConfig:
    """Scheduler settings.

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    max_num_seqs: int = 64
    """Requests running at once."""
    max_num_batched_tokens: int = 2048
    """Tokens computed in one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps."""
    encoder_cache_tokens: int = 16384
    """Media encoder outputs kept by content hash (LRU), in encoder rows = placeholder tokens
    (vLLM v1's encoder cache)."""
    max_num_encoder_tokens: int | None = None
    """Encoder rows (placeholder tokens) encoded per step (vLLM v1's encoder_compute_budget); one item
    larger still runs, alone in its step. None: max_num_batched_tokens."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not is_int(self.encoder_cache_tokens) or self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must be an int >= 0 (tokens), got {self.encoder_cache_tokens!r}")
        check_optional_positive("max_num_encoder_tokens", self.max_num_encoder_tokens, "tokens")
