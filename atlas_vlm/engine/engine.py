"""``LLMEngine``: add requests, step them together, stream what each step produced.

Per step: schedule -> run -> update -> outputs. The ``Scheduler`` picks chunks, the
``ModelRunner`` runs one batched forward and samples, ``Scheduler.update_from_output`` moves
requests on and finishes them, and the ``OutputProcessor`` turns new tokens into text,
applies stop strings and builds the ``RequestOutput``s. Every public method holds one lock,
so threads may share an engine (their calls run one at a time).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading

from atlas_vlm import hardware
from atlas_vlm.config import EngineConfig
from atlas_vlm.engine import assembly
from atlas_vlm.engine.input_processor import InputProcessor, ProcessedPrompt, RequestTooLongError
from atlas_vlm.engine.output_processor import OutputProcessor
from atlas_vlm.engine.request_stream import EngineStats
from atlas_vlm.loader import eos_token_ids, load_model
from atlas_vlm.lora.manager import attach_lora
from atlas_vlm.worker.kv_tier_builder import build_kv_tier
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.pooling_params import PoolingParams
from atlas_vlm.request import Request
from atlas_vlm.sampling_params import SamplingParams, check_for_model
from atlas_vlm.reasoning import get_reasoning_parser
from atlas_vlm.structured_output.manager import StructuredOutputManager

__all__ = ["LLMEngine", "RequestTooLongError"]

log = logging.getLogger(__name__)

_COMPILE_WAIT_S = 0.05  # longest a step with nothing to run waits for a grammar to compile


def _locked(method):
    """Run ``method`` under the engine's lock (re-entrant)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def _load(config: EngineConfig):
    """Set the CPU threads, then ``load_model`` with the model config's checkpoint options (a
    ``.gguf`` with ``deterministic=True`` and no quantization named: its dense copy).

    Raises:
        ModelNotFoundError, UnsupportedModelError: from loading.
    """
    device, model_config = config.torch_device(), config.model_config
    if device.type == "cpu":
        hardware.apply_num_threads(config.device_config.num_threads)
    quantization = model_config.quantization
    if quantization is None and config.device_config.deterministic and str(model_config.model).endswith(".gguf"):
        quantization = "dequantize"  # batch-invariant mode runs dense weights: a .gguf's dense copy, not as stored
    return load_model(model_config.model, dtype=config.torch_dtype(), device=device, revision=model_config.revision,
                      quantization=quantization, mmproj=model_config.mmproj, hf_file=model_config.hf_file)


class LLMEngine:
    """The engine behind ``LLM``.

    Args:
        config: ``EngineConfig``.

    Raises:
        ModelNotFoundError, UnsupportedModelError: from loading.
        KVBudgetError: the KV budget holds no block (or not a hybrid model's state slots).
        ValueError: a combination of options the engine refuses (``engine.plan_rules.RULES``).

    What it is built from, and why, is ``plan`` (``engine.plan.EnginePlan``, made once by
    ``engine.assembly``; ``reset`` builds the block manager and scheduler again from it).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        loaded = _load(config)
        self.tokenizer, self.hf_config = loaded.tokenizer, loaded.hf_config
        self.plan, self.runner = assembly.build_runner(config, loaded)  # what the engine is built from, and why
        caps = self.runner.capabilities
        if caps.hybrid and config.cache_config.prefix_caching and not self.plan.prefix_caching.value:
            log.info("prefix caching off for %s: a hybrid model's prefix hit would skip tokens whose recurrent "
                     "state is not stored", caps.model_class)
        self.max_model_len, self.vocab_size = self.plan.max_model_len, loaded.model.arch.vocab_size
        # the disk tier below the prefix cache (None without kv_cache_dir)
        self.kv_tier = build_kv_tier(config, loaded.model_dir, loaded.hf_config, self.runner)
        eos = eos_token_ids(self.tokenizer, loaded.model_dir)
        self.reasoning_parser = get_reasoning_parser(config.model_config.reasoning_parser, self.tokenizer)
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, self.vocab_size, eos,
                                                                 self.reasoning_parser)
        self.services = assembly.EngineServices(self.kv_tier, self.structured_output_manager,
                                                assembly.build_proposer(config, self.runner, self.hf_config))
        self.block_manager, self.scheduler = assembly.build_engine_parts(self.plan, self.runner, self.services, eos)
        self.input_processor = InputProcessor(self.tokenizer, self.hf_config, config, self.vocab_size,
                                              self.max_model_len, self.block_manager, self.runner.device,
                                              loaded.image_settings)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._finished_outside_step: list[RequestOutput] = []  # aborts, handed out by the next step
        self._lock = threading.RLock()

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end a request (unless ``ignore_eos``); the scheduler's set."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.scheduler.eos_token_ids = set(ids)
        self.structured_output_manager.set_eos_token_ids(ids)

    # ---- requests ---------------------------------------------------------------------
    def process_prompt(self, prompt) -> ProcessedPrompt:
        """Prompt ids, images and positions of any prompt form (``InputProcessor.process_prompt``)."""
        return self.input_processor.process_prompt(prompt)

    def process_request(self, prompt, sampling_params: SamplingParams | None = None,
                        request_id: str | None = None, lora_request=None) -> Request:
        """Everything heavy of ``add_request`` without touching the engine's state: tokenize,
        load / resize / patchify images, validate. Safe to call from worker threads while
        another thread steps the engine (``AsyncLLM`` does so); pass the ``Request`` it returns
        to ``add_request``.

        Raises: as ``add_request`` (nothing is queued or allocated).
        """
        if isinstance(sampling_params, SamplingParams):
            sampling_params = copy.deepcopy(sampling_params)  # the caller may change theirs later (vLLM clones too)
        req = self.input_processor.process(prompt, sampling_params, request_id)
        attach_lora(self.runner.lora, req, lora_request)  # a LoRARequest: read and checked now if new
        check_for_model(req.sampling_params, self.vocab_size)
        if req.pooling_params is not None:
            req.pooling_params.check_for_model(self.runner.model.arch.hidden_size)
        return req

    def validate_prompt(self, prompt, sampling_params: SamplingParams | None = None):
        """The checks of ``process_request`` (prompt form, ids, length, sampling params for
        this model) without making a request: the ``ProcessedPrompt``, which ``add_request``
        / ``process_request`` take as a prompt without processing it again. Thread-safe as
        ``process_request``. Raises: as ``add_request`` (nothing is queued or allocated)."""
        p = self.input_processor.validate(prompt, sampling_params)
        if isinstance(sampling_params, PoolingParams):
            sampling_params.check_for_model(self.runner.model.arch.hidden_size)
        elif sampling_params is not None:
            check_for_model(sampling_params, self.vocab_size)
        return p

    @_locked
    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, lora_request=None) -> str:
        """Validate and queue one request; returns its id. ``prompt`` may be a ``Request``
        from ``process_request`` (then ``sampling_params`` and ``request_id`` are its own).
        ``sampling_params`` may be a ``PoolingParams`` (vLLM's ``params``): an embedding
        request, whose prompt runs in the same steps as generation and whose one final
        output carries ``embedding``.

        Raises (nothing is queued or allocated):
            RequestTooLongError: prompt (+ ``max_tokens``) over ``max_model_len`` or the KV capacity.
            mm_token_pipeline.ImageInputError: an image cannot be loaded or resized.
            ValueError, TypeError: any other malformed input, or a request id already in use;
                a ``lora_request`` (``atlas_vlm.lora.LoRARequest``) refused (``LoRAAdapterError``)
                or with every adapter slot busy.

        A structured-output grammar compiles off the engine thread (the request waits in
        ``WAITING_FOR_FSM`` meanwhile); one the library refuses only then ends that request
        with ``finish_reason="error"`` and ``error`` naming the field (vLLM v1).
        """
        req = prompt if isinstance(prompt, Request) else \
            self.process_request(prompt, sampling_params, request_id, lora_request)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora_request is not None:  # its adapter into a slot (an idle one may leave)
            self.runner.lora.activate(req.lora_request, self.lora_ids_in_flight())
        self.structured_output_manager.add_request(req)  # its grammar compiles off this thread
        if self.config.speculative_config.method is not None and req.pooling_params is None:
            req.spec_decode = {"drafts": 0, "proposed": 0, "accepted": 0}
        self.requests[req.request_id] = req
        self.output_processor.add_request(req.request_id, req.prompt, req.token_ids, req.sampling_params.stop,
                                          req.sampling_params.output_kind)
        self.scheduler.add_request(req)
        return req.request_id

    def lora_ids_in_flight(self) -> set[int]:
        """``lora_int_id`` of every unfinished request's adapter."""
        reqs = list(self.requests.values())  # one C call under the GIL: safe from a server thread
        return {r.lora_request.lora_int_id for r in reqs if r.lora_request is not None}

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
    def reset(self) -> list[str]:
        """Drop every request and start the KV cache afresh (a new ``BlockManager``: no block
        held, no prefix-cache entry; the encoder cache emptied); the weights and the disk KV
        tier stay. For after a step raised midway, when request and block state can no longer
        be trusted. Returns the ids of the requests dropped (their outputs are not handed out)."""
        dropped = list(self.requests)
        for req in self.requests.values():  # state slots back (the blocks go with the old manager), grammars dropped
            self.block_manager.free_request(req)
            self.structured_output_manager.remove_request(req.request_id)
        self.block_manager, self.scheduler = assembly.build_engine_parts(
            self.plan, self.runner, self.services, self.scheduler.eos_token_ids, previous=self.scheduler)
        self.input_processor.block_manager, self.output_processor = self.block_manager, OutputProcessor(self.tokenizer)
        self.runner.encoder_outputs.clear()
        self.requests, self._finished_outside_step = {}, []
        return dropped

    @_locked
    def reset_mm_cache(self) -> None:
        """Evict every encoder-cache entry no request still needs (vLLM's ``reset_mm_cache``):
        the runner drops their rows now; a later request with the same media encodes it again."""
        self.scheduler.encoder_cache.clear()
        self.runner.drop_encoder_outputs(self.scheduler.encoder_cache.take_freed())

    @_locked
    def stats(self) -> EngineStats:
        """The engine now, as one frozen value (``AsyncLLM`` and ``/metrics`` read this, not the
        scheduler, block manager, disk tier or snapshot pool): requests running and waiting, KV
        blocks, preemptions, speculative decoding, disk-tier and state-snapshot totals."""
        sched, bm, tier, pool = self.scheduler, self.block_manager, self.kv_tier, self.block_manager.state_snapshots
        spec = sched.spec_decode_stats
        disk = (tier.disk.hits, tier.disk.misses, tier.disk.bytes_stored) if tier is not None else (0, 0, 0)
        return EngineStats(len(sched.running), len(sched.waiting), bm.num_blocks, bm.num_free_blocks,
                           sched.num_preemptions, spec["drafts"], spec["proposed"], spec["accepted"], *disk,
                           *((pool.queries, pool.hits) if pool is not None else (0, 0)))

    @property
    def num_waiting(self) -> int:
        """Requests queued, not yet running (read without the lock: a length, safe from any thread)."""
        return len(self.scheduler.waiting)

    @_locked
    def has_unfinished_requests(self) -> bool:
        """Requests still queued or running, or final outputs not yet handed out by ``step``."""
        return self.scheduler.has_unfinished() or bool(self._finished_outside_step)

    # ---- stepping ---------------------------------------------------------------------
    @_locked
    def step(self) -> list[RequestOutput]:
        """Run one batched step: schedule -> run -> update -> outputs. Returns an output
        (with the step's new tokens and text) for every request that produced a token or
        finished in it (a ``FINAL_ONLY`` request: only when it finished), after the outputs of
        requests aborted since the last step (and of requests whose grammar failed to compile).
        With nothing to run but grammars compiling, it waits for one at most ``_COMPILE_WAIT_S``
        seconds."""
        outputs, self._finished_outside_step = self._finished_outside_step, []
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.failed and self.structured_output_manager.is_compiling_any():
            # only grammars compiling: wait a little for one (bounded, so aborts and new
            # requests are not held up), then try again
            self.structured_output_manager.wait_for_compiles(_COMPILE_WAIT_S)
            sched = self.scheduler.schedule()
        for req in sched.failed:  # its grammar could not be compiled: it ends alone
            outputs.append(self.output_processor.finish(req))
            del self.requests[req.request_id]
        if sched.is_empty:
            return outputs
        try:
            runner_output = self.runner.run(sched.chunks, grammar_bitmask=sched.grammar_bitmask,
                                            encoder_inputs=sched.encoder_inputs,
                                            freed_encoder_hashes=sched.freed_encoder_hashes)
        except BaseException:
            self.scheduler.undo_drafts(sched)  # the step did not happen: drafts are no tokens to compute
            # items the step was to encode but did not: not cached after all
            self.scheduler.encoder_cache.forget(h for h in sched.encoder_inputs
                                                if h not in self.runner.encoder_outputs)
            raise
        for req, new_token_ids in self.scheduler.update_from_output(sched, runner_output):
            out, stopped = self.output_processor.process(req, new_token_ids)
            if stopped or (out is not None and out.finish_reason == "stop" != req.finish_reason):
                self.scheduler.finish(req, "stop")  # a stop string: reported by the output processor, ended here
            if req.finish_reason is not None:
                del self.requests[req.request_id]
            if out is not None:
                outputs.append(out)
        return outputs
