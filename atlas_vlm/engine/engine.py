"""``LLMEngine``: add requests, step them together, stream what each step produced.

Per step: the ``Scheduler`` picks chunks, the ``ModelRunner`` runs one batched forward and
samples, and the engine applies stopping rules and frees finished requests' blocks.
"""

from __future__ import annotations

from atlas_vlm.config import EngineConfig
from atlas_vlm.engine.input_processor import InputProcessor, ProcessedPrompt, RequestTooLongError
from atlas_vlm.loader import eos_token_ids, load_model
from atlas_vlm.worker.model_runner import ModelRunner
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.request import Request
from atlas_vlm.sampling_params import SamplingParams
from atlas_vlm.engine.scheduler import Scheduler
from mm_kv_cache_management import BlockManager

__all__ = ["LLMEngine", "RequestTooLongError"]


class LLMEngine:
    """The engine behind ``LLM``.

    Args:
        config: ``EngineConfig``.

    Raises:
        ModelNotFoundError, UnsupportedModelError: from loading.
        KVBudgetError: the KV budget holds no block.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        device, dtype = config.torch_device(), config.torch_dtype()
        loaded = load_model(config.model, dtype=dtype, device=device)
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        arch = loaded.model.arch
        self.max_model_len = config.max_model_len or min(arch.max_position_embeddings, 4096)
        self.runner = ModelRunner(loaded, config, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.runner.block_size,
            enable_prefix_caching=config.enable_prefix_caching and config.kv_cache == "paged",
        )
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, budget, config.enable_chunked_prefill)
        self.input_processor = InputProcessor(self.tokenizer, self.hf_config, config, arch.vocab_size,
                                              self.max_model_len, self.block_manager, self.runner.device)
        self.eos_token_ids = eos_token_ids(self.tokenizer, loaded.model_dir)
        self.requests: dict[str, Request] = {}

    # ---- requests ---------------------------------------------------------------------
    def process_prompt(self, prompt) -> ProcessedPrompt:
        """Prompt ids, images and positions of any prompt form (``InputProcessor.process_prompt``)."""
        return self.input_processor.process_prompt(prompt)

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id.

        Raises (nothing is queued or allocated):
            RequestTooLongError: prompt (+ ``max_tokens``) over ``max_model_len`` or the KV capacity.
            mm_token_pipeline.ImageInputError: an image cannot be loaded or resized.
            ValueError, TypeError: any other malformed input, or a request id already in use.
        """
        req = self.input_processor.process(prompt, sampling_params, request_id)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)
        return req.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are freed. None if the id is unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batched step; returns an output (with the step's new tokens) for every
        request that produced a token or finished in it."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        results = self.runner.run(sched.chunks)
        for req, n in sched.chunks:
            req.num_computed_tokens += n
            req.block_table.num_tokens = req.num_computed_tokens
            self.block_manager.cache_full_blocks(req)
        outputs = []
        for index, token, logprob, top in results:
            req = sched.chunks[index][0]
            req.token_ids.append(token)
            if logprob is not None:
                req.logprobs.append(logprob)
                req.top_logprobs.append(top)
            self._check_stop(req, token)
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                del self.requests[req.request_id]
            outputs.append(self._output(req))
        return outputs

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.sampling_params
        req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            req.finish_reason = "stop"
        for s in params.stop:
            at = req.text.find(s)
            if at != -1:
                req.text = req.text[:at]
                req.finish_reason = "stop"
        if req.finish_reason is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            req.finish_reason = "length"

    def _output(self, req: Request) -> RequestOutput:
        out_ids = req.output_token_ids
        text = req.text
        if req.finish_reason is None and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")  # hold back an incomplete UTF-8 character while streaming
        new_ids, new_text = out_ids[req.stream_sent_tokens:], text[req.stream_sent_chars:]
        req.stream_sent_tokens, req.stream_sent_chars = len(out_ids), max(req.stream_sent_chars, len(text))
        asked = req.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
            text=text, token_ids=list(out_ids), finish_reason=req.finish_reason,
            logprobs=list(req.logprobs) if asked else None, top_logprobs=list(req.top_logprobs) if asked else None,
            new_token_ids=new_ids, new_text=new_text,
        )
