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
from atlas_vlm.engine.encoder_cache_manager import EncoderCacheManager
from atlas_vlm.engine.input_processor import InputProcessor, ProcessedPrompt, RequestTooLongError
from atlas_vlm.engine.output_processor import OutputProcessor
from atlas_vlm.loader import eos_token_ids, load_model
from atlas_vlm.worker.kv_tier_builder import build_kv_tier
from atlas_vlm.worker.model_runner import ModelRunner
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.pooling_params import PoolingParams
from atlas_vlm.request import Request
from atlas_vlm.sampling_params import SamplingParams, check_for_model
from atlas_vlm.engine.scheduler import Scheduler
from atlas_vlm.reasoning import get_reasoning_parser
from atlas_vlm.structured_output.manager import StructuredOutputManager
from mm_kv_cache_management import BlockManager

__all__ = ["LLMEngine", "RequestTooLongError"]

log = logging.getLogger(__name__)

_COMPILE_WAIT_S = 0.05  # longest a step with nothing to run waits for a grammar to compile
# drafters tested on hybrid models (their recurrent state rolls back by accepted counts alone,
# whatever the drafter: ``StateCache.accept_rows``); add one here once its hybrid runs are tested
_HYBRID_SPECULATIVE = ("ngram", "mtp")


def _locked(method):
    """Run ``method`` under the engine's lock (re-entrant)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def _check_hybrid(config: EngineConfig, model, snapshots) -> bool:
    """The options a hybrid ``model`` (recurrent-state layers) runs with; returns whether prefix
    caching is on: only with a state-snapshot pool (``snapshots``, the runner's
    ``state_snapshots``), else off (a hit would skip tokens whose recurrent state is not stored;
    one log line when it was asked for).

    Raises:
        ValueError: speculative decoding with a model whose layers do not keep a state per
            verified row (no ``supports_state_rollback``: rejected drafts could not be rolled
            back) or a drafter not in ``_HYBRID_SPECULATIVE``; ``kv_cache_dir`` without a
            snapshot pool (``max_state_snapshots=0``: no prefix caching). With one, the disk
            tier serves hybrid models: their snapshots are written beside their blocks.
    """
    model_name = type(model).__name__
    method = config.speculative_config.method
    if method is not None and not getattr(model, "supports_state_rollback", False):
        raise ValueError(f"speculative={method!r} cannot run {model_name}, a hybrid model: its "
                         "recurrent state cannot roll back rejected drafts; pass speculative=None")
    if method is not None and method not in _HYBRID_SPECULATIVE:
        raise ValueError(f"speculative={method!r} is not tested on hybrid models such as {model_name} "
                         f"yet; pass one of {_HYBRID_SPECULATIVE} or None")
    if snapshots is not None:
        return True
    if config.cache_config.kv_cache_dir is not None:
        raise ValueError(f"kv_cache_dir needs prefix caching, which {model_name}, a hybrid model, only has with "
                         "state snapshots: set max_state_snapshots >= 1, or unset kv_cache_dir")
    if config.cache_config.prefix_caching:
        log.info("prefix caching off for %s: a hybrid model's prefix hit would skip tokens whose recurrent "
                 "state is not stored", model_name)
    return False


def _check_mtp(config: EngineConfig) -> None:
    """The options ``speculative="mtp"`` runs with. Its prefix hits drop their last block
    (``BlockManager.drop_last_hit_block``, set by the engine): that block's last MTP K/V were
    made with the next token of the request that wrote it.

    Raises:
        ValueError: ``kv_cache_dir`` asked for (a disk hit would resume past the last memory
            hit, whose last block's MTP K/V are the writer's).
    """
    if config.cache_config.kv_cache_dir is not None:
        raise ValueError("kv_cache_dir cannot serve speculative='mtp' (a disk hit's last block holds MTP K/V made "
                         "with another request's next token); unset kv_cache_dir or use speculative='ngram'")


class LLMEngine:
    """The engine behind ``LLM``.

    Args:
        config: ``EngineConfig``.

    Raises:
        ModelNotFoundError, UnsupportedModelError: from loading.
        KVBudgetError: the KV budget holds no block (or not a hybrid model's state slots).
        ValueError: an option a hybrid model cannot run with (``_check_hybrid``).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        device, dtype = config.torch_device(), config.torch_dtype()
        model_config, cache_config = config.model_config, config.cache_config
        scheduler_config, spec_config = config.scheduler_config, config.speculative_config
        if device.type == "cpu":
            hardware.apply_num_threads(config.device_config.num_threads)
        loaded = load_model(model_config.model, dtype=dtype, device=device, revision=model_config.revision,
                            quantization=model_config.quantization, mmproj=model_config.mmproj)
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        arch = loaded.model.arch
        self.max_model_len = model_config.max_model_len or min(arch.max_position_embeddings, 4096)
        self.runner = ModelRunner(loaded, config, self.max_model_len)
        state_cache = self.runner.state_cache  # hybrid models' recurrent-state slots (None otherwise)
        prefix_caching = cache_config.prefix_caching
        if state_cache is not None:
            prefix_caching = _check_hybrid(config, loaded.model, self.runner.state_snapshots)
        if spec_config.method == "mtp":
            _check_mtp(config)
        # the disk tier below the prefix cache (None without kv_cache_dir)
        self.kv_tier = build_kv_tier(config, loaded.model_dir, loaded.hf_config, self.runner)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          enable_prefix_caching=prefix_caching, kv_tier=self.kv_tier,
                                          state_cache=state_cache, state_snapshots=self.runner.state_snapshots)
        self.block_manager.drop_last_hit_block = spec_config.method == "mtp"
        budget = scheduler_config.max_num_batched_tokens
        if not scheduler_config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        eos = eos_token_ids(self.tokenizer, loaded.model_dir)
        self.reasoning_parser = get_reasoning_parser(model_config.reasoning_parser, self.tokenizer)
        self.structured_output_manager = StructuredOutputManager(self.tokenizer, arch.vocab_size, eos,
                                                                 self.reasoning_parser)
        self.scheduler = Scheduler(self.block_manager, scheduler_config.max_num_seqs, budget,
                                   scheduler_config.enable_chunked_prefill,
                                   max_model_len=self.max_model_len, eos_token_ids=eos,
                                   structured_output_manager=self.structured_output_manager,
                                   max_num_encoder_tokens=scheduler_config.max_num_encoder_tokens or budget,
                                   encoder_cache=EncoderCacheManager(scheduler_config.encoder_cache_tokens),
                                   proposer=self._proposer(), num_speculative_tokens=spec_config.speculative_tokens,
                                   speculative_disable_by_batch_size=spec_config.disable_by_batch_size)
        self.input_processor = InputProcessor(self.tokenizer, self.hf_config, config, arch.vocab_size,
                                              self.max_model_len, self.block_manager, self.runner.device,
                                              loaded.image_settings)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = arch.vocab_size
        self.requests: dict[str, Request] = {}
        self._finished_outside_step: list[RequestOutput] = []  # aborts, handed out by the next step
        self._lock = threading.RLock()

    def _proposer(self):
        """The draft proposer of ``speculative_config.method`` (None: off); placeholder ids of
        the model's media are never drafted."""
        spec = self.config.speculative_config
        if spec.method is None:
            return None
        if spec.method == "mtp":  # drafts made by the runner's MTP head after each step
            return self.runner.drafter.proposer
        from atlas_vlm.spec_decode import NgramProposer, placeholder_token_ids

        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min, placeholder_token_ids(self.hf_config))

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
                        request_id: str | None = None) -> Request:
        """Everything heavy of ``add_request`` without touching the engine's state: tokenize,
        load / resize / patchify images, validate. Safe to call from worker threads while
        another thread steps the engine (``AsyncLLM`` does so); pass the ``Request`` it returns
        to ``add_request``.

        Raises: as ``add_request`` (nothing is queued or allocated).
        """
        if isinstance(sampling_params, SamplingParams):
            sampling_params = copy.deepcopy(sampling_params)  # the caller may change theirs later (vLLM clones too)
        req = self.input_processor.process(prompt, sampling_params, request_id)
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
                    request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id. ``prompt`` may be a ``Request``
        from ``process_request`` (then ``sampling_params`` and ``request_id`` are its own).
        ``sampling_params`` may be a ``PoolingParams`` (vLLM's ``params``): an embedding
        request, whose prompt runs in the same steps as generation and whose one final
        output carries ``embedding``.

        Raises (nothing is queued or allocated):
            RequestTooLongError: prompt (+ ``max_tokens``) over ``max_model_len`` or the KV capacity.
            mm_token_pipeline.ImageInputError: an image cannot be loaded or resized.
            ValueError, TypeError: any other malformed input, or a request id already in use.

        A structured-output grammar compiles off the engine thread (the request waits in
        ``WAITING_FOR_FSM`` meanwhile); one the library refuses only then ends that request
        with ``finish_reason="error"`` and ``error`` naming the field (vLLM v1).
        """
        req = prompt if isinstance(prompt, Request) else self.process_request(prompt, sampling_params, request_id)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.structured_output_manager.add_request(req)  # its grammar compiles off this thread
        if self.config.speculative_config.method is not None and req.pooling_params is None:
            req.spec_decode = {"drafts": 0, "proposed": 0, "accepted": 0}
        self.requests[req.request_id] = req
        self.output_processor.add_request(req.request_id, req.prompt, req.token_ids, req.sampling_params.stop,
                                          req.sampling_params.output_kind)
        self.scheduler.add_request(req)
        return req.request_id

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
        old = self.block_manager
        for req in self.requests.values():  # their state slots back (the blocks go with the old manager)
            old.free_request(req)
        self.block_manager = BlockManager(old.num_blocks, old.block_size,
                                          enable_prefix_caching=old.enable_prefix_caching, kv_tier=old.kv_tier,
                                          state_cache=old.state_cache, state_snapshots=old.state_snapshots)
        self.block_manager.drop_last_hit_block = old.drop_last_hit_block
        sched = self.scheduler
        self.scheduler = Scheduler(self.block_manager, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   sched.enable_chunked_prefill, max_model_len=sched.max_model_len,
                                   eos_token_ids=sched.eos_token_ids,
                                   structured_output_manager=sched.structured_output_manager,
                                   max_num_encoder_tokens=sched.max_num_encoder_tokens,
                                   encoder_cache=EncoderCacheManager(sched.encoder_cache.capacity_tokens),
                                   proposer=sched.proposer, num_speculative_tokens=sched.num_speculative_tokens,
                                   speculative_disable_by_batch_size=sched.speculative_disable_by_batch_size)
        self.scheduler.num_preemptions = sched.num_preemptions  # running totals (metrics)
        self.scheduler.spec_decode_stats = sched.spec_decode_stats
        self.input_processor.block_manager = self.block_manager
        self.output_processor = OutputProcessor(self.tokenizer)
        self.runner.encoder_outputs.clear()
        for req in self.requests.values():
            if self.structured_output_manager is not None:
                self.structured_output_manager.remove_request(req.request_id)
        self.requests = {}
        self._finished_outside_step = []
        return dropped

    @_locked
    def reset_mm_cache(self) -> None:
        """Evict every encoder-cache entry no request still needs (vLLM's ``reset_mm_cache``):
        the runner drops their rows now; a later request with the same media encodes it again."""
        self.scheduler.encoder_cache.clear()
        self.runner.drop_encoder_outputs(self.scheduler.encoder_cache.take_freed())

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
            if stopped:  # a stop string: the output processor ended it
                self.scheduler.finish(req)
            if req.finish_reason is not None:
                del self.requests[req.request_id]
            if out is not None:
                outputs.append(out)
        return outputs
