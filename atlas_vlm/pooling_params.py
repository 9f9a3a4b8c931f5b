"""``PoolingParams``: what an embedding request (``LLM.embed``, ``/v1/embeddings``) asks for,
in place of ``SamplingParams`` (vLLM's ``PoolingParams`` for the embed task)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")


class PoolingParamsError(ValueError):
    """A pooling parameter the model cannot honour; ``param`` names it (the server's error field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt's final hidden states (after the decoder's final norm) become one vector.

    Args:
        pooling: "last" (default): the last prompt token's hidden state (vLLM's LAST pooler,
            what Qwen3-VL-Embedding uses); "mean": the mean over every prompt token.
        normalize: L2-normalise the vector (default True, as vLLM's embed task).
        dimensions: keep only the first ``dimensions`` values (Matryoshka truncation, applied
            before normalisation, as vLLM / OpenAI ``dimensions``); None: the hidden size.
            More than the model's hidden size is refused when the request is added.

    A pooling request runs its prompt only (prefill, batched with generation) and finishes
    when the prompt is computed; its ``RequestOutput.embedding`` holds the vector.

    Raises:
        ValueError: ``pooling`` not one of ``POOLING_TYPES``, ``normalize`` not a bool,
            ``dimensions`` not a positive int.
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self):
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")

    def check_for_model(self, hidden_size: int) -> None:
        """Raises PoolingParamsError (a ValueError): ``dimensions`` over the model's ``hidden_size``."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise PoolingParamsError(f"dimensions ({self.dimensions}) is over this model's hidden size ({hidden_size})",
                                     "dimensions")
