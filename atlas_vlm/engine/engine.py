"""``LLMEngine``: add requests, step them together, stream what each step produced.

Per step: the ``Scheduler`` picks chunks, the ``ModelRunner`` runs one batched forward and
samples, and the engine applies stopping rules and frees finished requests' blocks.
"""

from __future__ import annotations

import itertools

import torch
from transformers import GenerationConfig

from atlas_vlm.config import EngineConfig
from atlas_vlm.engine.input_processor import InputProcessor, ProcessedPrompt
from atlas_vlm.loader import load_model
from atlas_vlm.worker.model_runner import ModelRunner
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.request import Request
from atlas_vlm.sampling_params import SamplingParams
from atlas_vlm.engine.scheduler import Scheduler
from mm_kv_cache_management import BlockManager


class RequestTooLongError(ValueError):
    """A request can never fit: over ``max_model_len`` or over the whole KV capacity."""


def _eos_token_ids(tokenizer, model_dir) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        gen = None
    ids |= set(gen if isinstance(gen, list) else [gen] if gen is not None else [])
    return ids


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
        loaded = load_model(config.model, dtype=dtype, device=device, revision=config.revision)
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
        self.inputs = InputProcessor(self.tokenizer, self.hf_config, config, arch.vocab_size)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, loaded.model_dir)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()  # default request ids
        self._seeds = itertools.count()  # default seeds: engine seed + arrival index

    # ---- requests ---------------------------------------------------------------------
    def process_prompt(self, prompt) -> ProcessedPrompt:
        """str | list[int] | {"prompt"/"prompt_token_ids"/"messages": ..., "mm_options": ...}."""
        if isinstance(prompt, str):
            return self.inputs.from_text(prompt)
        if isinstance(prompt, dict):
            if "messages" in prompt:
                return self.inputs.from_messages(prompt["messages"], prompt.get("mm_options"))
            if "prompt_token_ids" in prompt:
                return self.inputs.from_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.inputs.from_text(prompt["prompt"])
        if isinstance(prompt, list):
            return self.inputs.from_token_ids(prompt)
        raise TypeError(f"a prompt is a str, a list of token ids or a dict with 'prompt', "
                        f"'prompt_token_ids' or 'messages'; got {type(prompt).__name__}")

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id.

        Raises (nothing is queued or allocated):
            RequestTooLongError: prompt (+ ``max_tokens``) over ``max_model_len`` or the KV capacity.
            mm_token_pipeline.ImageInputError: an image cannot be loaded or resized.
            ValueError, TypeError: any other malformed input.
        """
        params = sampling_params or SamplingParams()
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt)
        num_prompt = len(p.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise RequestTooLongError(
                f"prompt is {num_prompt} tokens (text and image tokens together); max_model_len is "
                f"{self.max_model_len}, which must leave room for at least one generated token"
            )
        max_tokens = params.max_tokens or (self.max_model_len - num_prompt)
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"is over max_model_len {self.max_model_len}"
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if self.block_manager.num_blocks_needed(num_prompt + max_tokens) > self.block_manager.num_blocks:
            raise RequestTooLongError(
                f"prompt ({num_prompt}) + max_tokens ({max_tokens}) tokens can never fit the KV cache "
                f"({self.block_manager.num_blocks} blocks, {capacity} tokens)"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(params.seed if params.seed is not None else self.config.seed + next(self._seeds))
        req = Request(
            request_id=request_id, token_ids=list(p.prompt_token_ids), image_spans=p.image_spans,
            rope_delta=p.rope_delta, sampling_params=params, prompt=p.prompt, max_tokens=max_tokens,
            images=p.images, mrope_positions=p.mrope_positions, generator=generator,
        )
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return request_id

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
