"""``Request``: a request as the engine tracks it (the KV-side ``RequestState`` plus sampling,
media items of any modality in ``mm_features`` (each with its placeholder ranges), sampled tokens
and how it finished; or, for an embedding request, ``pooling_params`` and its ``embedding``). Text and stream deltas live in the ``OutputProcessor``'s per-request
state."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atlas_vlm.pooling_params import PoolingParams
from atlas_vlm.sampling_params import SamplingParams
from mm_kv_cache_management import RequestState


@dataclass(eq=False)
class Request(RequestState):
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None  # prompt text, when given as text
    max_tokens: int = 16  # resolved generation limit (tokens)
    mrope_positions: torch.Tensor | None = None  # [3, num_prompt_tokens] M-RoPE positions (None: text model)
    generator: torch.Generator | None = None  # per-request sampling RNG
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    error: str | None = None  # why it failed (finish_reason == "error")
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # set: an embedding request (prompt only, no sampling)
    pooled_sum: torch.Tensor | None = None  # "mean" pooling: fp32 [hidden] sum of the rows computed so far
    embedding: list[float] | None = None  # the pooled vector once the prompt is computed (worker.pooler)
    # speculative decoding (atlas_vlm.spec_decode): the draft tokens of the step in flight (they sit
    # at the end of token_ids from schedule to update_from_output), and per-request counts
    # {"proposed", "accepted", "steps"} (None: speculation off in this engine)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_decode: dict | None = None
    spec_acceptance: float = 1.0  # recent fraction of drafts accepted (moving average; spec_decode.scheduling)
    lora_request: object | None = None  # its atlas_vlm.lora.LoRARequest (None: the base model)

    def block_hashes(self, block_size: int, num_tokens: int | None = None) -> list[bytes]:
        """As ``RequestState.block_hashes``, but none for a "mean" pooling request: it needs
        every prompt token's hidden state, so it never starts past a prefix-cache hit (nor
        offers its blocks); vLLM likewise turns prefix caching off for mean pooling."""
        if self.pooling_params is not None and self.pooling_params.pooling == "mean":
            return []
        return super().block_hashes(block_size, num_tokens)

    def drop_last_tokens(self, n: int) -> None:
        """Forget the last ``n`` generated tokens (and their logprobs): tokens a stop string
        found inside a step's accepted speculative run made void. ``n`` <= generated tokens.

        Raises:
            ValueError: ``n`` is negative or more than the generated tokens.
        """
        if not 0 <= n <= self.num_output_tokens:
            raise ValueError(f"request {self.request_id!r}: cannot drop {n} of {self.num_output_tokens} "
                             f"generated tokens")
        if n:
            del self.token_ids[-n:]
            keep = max(0, len(self.logprobs) - n)
            del self.logprobs[keep:], self.top_logprobs[keep:]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Positions of tokens ``start .. end-1``: ``[n]`` for text, ``[3, n]`` with M-RoPE.

        Prompt tokens take HF ``get_rope_index`` positions; a later token ``i`` (generated,
        or recomputed after preemption) takes ``i + rope_delta`` on all three axes.
        """
        if self.mrope_positions is None:
            return torch.arange(start, end)
        prompt_end = min(end, self.num_prompt_tokens)
        parts = [self.mrope_positions[:, start:prompt_end]] if start < prompt_end else []
        if end > self.num_prompt_tokens:
            tail = torch.arange(max(start, self.num_prompt_tokens), end) + self.rope_delta
            parts.append(tail[None].expand(3, -1))
        return torch.cat(parts, dim=1)  # [3, n]
