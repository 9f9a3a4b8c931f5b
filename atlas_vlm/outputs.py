"""What a finished (or streaming) request hands back to the caller."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """Result of one request.

    ``finish_reason``: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort", "error" (then ``error`` says why and nothing else is set), or
    ``None`` while still running (streaming).

    What ``text``, ``token_ids``, ``logprobs`` and ``top_logprobs`` hold follows the request's
    ``SamplingParams.output_kind``: everything so far (CUMULATIVE, FINAL_ONLY) or only what
    the step added (DELTA, whose ``prompt_token_ids`` are in the request's first output only).
    """

    request_id: str
    prompt: str | None  # the prompt text, when given as text
    prompt_token_ids: list[int]  # prompt ids, image pads expanded
    text: str = ""  # generated text so far
    token_ids: list[int] = field(default_factory=list)  # generated ids so far
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # per generated token: its logprob (when asked)
    top_logprobs: list[dict[int, float]] | None = None  # per generated token: top-k {id: logprob}
    error: str | None = None  # why the request failed (finish_reason == "error")
    new_token_ids: list[int] = field(default_factory=list)  # streaming: ids added by the last step
    new_text: str = ""  # streaming: text added by the last step
    tool_calls: list[dict] | None = None  # LLM.chat(tools=...): OpenAI-shaped calls parsed from the finished text
    # LLM.chat with a reasoning parser (LLM(reasoning_parser="qwen3")): the finished text's thinking
    # and what follows it (the answer); ``text`` stays the whole generated text
    reasoning_content: str | None = None
    content: str | None = None
    # a pooling request (LLM.embed, PoolingParams): the pooled vector (floats), set on its final output
    embedding: list[float] | None = None
    stop_reason: str | None = None  # the stop string that ended the request (vLLM's ``stop_reason``), else None
    # speculative decoding on (EngineConfig.speculative): {"drafts": steps that carried drafts,
    # "proposed": draft tokens, "accepted": drafts accepted} for this request so far; else None
    spec_decode: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestOutput) -> RequestOutput:
        """Fold the next DELTA output of the same request into this one (vLLM
        ``RequestOutput.add``): text, ids and logprob entries appended, finish reason and
        error taken from ``delta``; ``new_text`` / ``new_token_ids`` become the delta's.
        Returns ``self`` (changed in place).

        Raises:
            ValueError: ``delta`` belongs to another request.
        """
        if delta.request_id != self.request_id:
            raise ValueError(f"cannot add an output of request {delta.request_id!r} to one of {self.request_id!r}")
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        for name in ("logprobs", "top_logprobs"):
            entries = getattr(delta, name)
            if entries is not None:
                if getattr(self, name) is None:
                    setattr(self, name, [])
                getattr(self, name).extend(entries)
        self.finish_reason, self.error, self.stop_reason = delta.finish_reason, delta.error, delta.stop_reason
        self.spec_decode = delta.spec_decode
        self.new_text, self.new_token_ids = delta.new_text, delta.new_token_ids
        return self
