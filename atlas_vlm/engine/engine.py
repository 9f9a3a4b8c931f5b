"""``LLMEngine``: add requests, step them together, stream what each step produced.

Per step: schedule -> run -> update -> outputs. The ``Scheduler`` picks chunks, the
``ModelRunner`` runs one batched forward and samples, ``Scheduler.update_from_output`` moves
requests on and finishes them, and the ``OutputProcessor`` turns new tokens into text,
applies stop strings and builds the ``RequestOutput``s. Every public method holds one lock,
so threads may share an engine (their calls run one at a time).
"""

from __future__ import annotations

import functools
import itertools
import threading

import torch
from transformers import GenerationConfig

from atlas_vlm.config import EngineConfig
from atlas_vlm.engine.input_processor import InputProcessor, ProcessedPrompt
from atlas_vlm.engine.output_processor import OutputProcessor
from atlas_vlm.loader import load_model
from atlas_vlm.worker.model_runner import ModelRunner
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.request import Request
from atlas_vlm.sampling_params import SamplingParams, check_for_model
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


def _locked(method):
    """Run ``method`` under the engine's lock (re-entrant)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


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
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, budget, config.enable_chunked_prefill,
                                   max_model_len=self.max_model_len,
                                   eos_token_ids=_eos_token_ids(self.tokenizer, loaded.model_dir))
        self.inputs = InputProcessor(self.tokenizer, self.hf_config, config, arch.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = arch.vocab_size
        self.requests: dict[str, Request] = {}
        self._finished_outside_step: list[RequestOutput] = []  # aborts, handed out by the next step
        self._lock = threading.RLock()
        self._ids = itertools.count()  # default request ids
        self._seeds = itertools.count()  # default seeds: engine seed + arrival index

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end a request (unless ``ignore_eos``); the scheduler's set."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.scheduler.eos_token_ids = set(ids)

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

    @_locked
    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id.

        Raises (nothing is queued or allocated):
            RequestTooLongError: prompt (+ ``max_tokens``) over ``max_model_len`` or the KV capacity.
            mm_token_pipeline.ImageInputError: an image cannot be loaded or resized.
            ValueError, TypeError: any other malformed input.
        """
        params = sampling_params or SamplingParams()
        check_for_model(params, self.vocab_size)
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
        self.output_processor.add_request(request_id, req.prompt, req.token_ids, params.stop)
        self.scheduler.add_request(req)
        return request_id

    @_locked
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are freed. Returns its final output
        (``finish_reason="abort"``, the text already streamed), which the next ``step()``
        also hands out, so that whoever steps the engine can route it. None if the id is
        unknown or finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        out = self.output_processor.finish(req)
        self._finished_outside_step.append(out)
        return out

    @_locked
    def has_unfinished_requests(self) -> bool:
        """Requests still queued or running, or final outputs not yet handed out by ``step``."""
        return self.scheduler.has_unfinished() or bool(self._finished_outside_step)

    # ---- stepping ---------------------------------------------------------------------
    @_locked
    def step(self) -> list[RequestOutput]:
        """Run one batched step: schedule -> run -> update -> outputs. Returns an output
        (with the step's new tokens and text) for every request that produced a token or
        finished in it, after the outputs of requests aborted since the last step."""
        outputs, self._finished_outside_step = self._finished_outside_step, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        runner_output = self.runner.run(sched.chunks)
        for req, new_token_ids in self.scheduler.update_from_output(sched, runner_output):
            out, stopped = self.output_processor.process(req, new_token_ids)
            if stopped:  # a stop string: the output processor ended it
                self.scheduler.finish(req)
            if req.finish_reason is not None:
                del self.requests[req.request_id]
            outputs.append(out)
        return outputs
