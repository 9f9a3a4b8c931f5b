"""``SamplingParams``: how one request picks its next tokens and when it stops (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling and stopping rules of one request.

    ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by the temperature,
    cut to the ``top_k`` best and the smallest set whose probability reaches ``top_p``, and
    sampled with a generator seeded by ``seed`` (reproducible per request).

    Raises:
        ValueError: on creation, naming the bad field and the allowed range.
    """

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None  # per-request RNG seed; None: the engine's seed + request index
    max_tokens: int | None = 16  # generated tokens at most; None: up to max_model_len
    stop_token_ids: list[int] = field(default_factory=list)  # stop after emitting one of these
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from the text)
    ignore_eos: bool = False  # keep going past the tokenizer's EOS
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob plus the top k

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int, -1 or 0 (off) or >= 1, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
