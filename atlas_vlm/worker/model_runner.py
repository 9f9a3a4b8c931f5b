"""``ModelRunner``: owns the model weights, the KV cache, the vision tower and its encoder
outputs (rows by content hash, which the scheduler's ``EncoderCacheManager`` decides), and runs
one batched forward per engine step. Scheduling and stopping rules live elsewhere."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from atlas_vlm import hardware
from atlas_vlm.config import EngineConfig
from atlas_vlm.layers.attention import resolve_attention_backend
from atlas_vlm.layers.batch_invariant import enable_batch_invariance, tile_linears
from atlas_vlm.layers.linear import can_pack, pack_linears
from atlas_vlm.worker.input_prep import ModelInput
from atlas_vlm.worker.step_executors import (CompiledDecodeExecutor, DecodeStepExecutor, EagerExecutor,
                                             StepInputs)
from atlas_vlm.loader import LoadedModel
from atlas_vlm.worker.pooler import pool_step
from atlas_vlm.worker.sampler import SamplerOutput
from atlas_vlm.spec_decode.rejection import sample_with_drafts  # worker.sampler.sample unless a sampled row has drafts
from atlas_vlm.memory_plan import kv_cache_spec, num_kv_blocks
from mm_kv_cache_management import ContiguousKVCache, PagedKVCache, StateCache, StateSpec
from mm_kv_cache_management.state_snapshots import StateSnapshotPool

log = logging.getLogger(__name__)


class KVBudgetError(ValueError):
    """The KV memory budget cannot hold a single block."""


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device, hf_config=None,
                          max_pixels: int | None = None) -> int:
    """Bytes the KV cache may take: ``kv_cache_memory`` on CPU; on CUDA
    ``memory_plan.kv_cache_budget``: ``gpu_memory_utilization`` of the device minus what is
    already allocated (weights of the decoder and the vision tower, measured) minus the
    activation reserve (``ACTIVATION_RESERVE_BYTES`` + the vision tower's peak at the engine's
    ``max_pixels``, ``memory_plan.vision_activation_peak``)."""
    if device.type != "cuda":
        return config.cache_config.kv_cache_memory
    from atlas_vlm import memory_plan

    free, total = torch.cuda.mem_get_info(device)
    dtype_bytes = torch.empty((), dtype=config.torch_dtype()).element_size()
    reserve = memory_plan.ACTIVATION_RESERVE_BYTES
    if hf_config is not None and max_pixels is not None:
        reserve += memory_plan.vision_activation_peak(hf_config, max_pixels, dtype_bytes)
    return memory_plan.kv_cache_budget(total, config.cache_config.gpu_memory_utilization, total - free, reserve)


def hybrid_state_spec(model) -> StateSpec | None:
    """A hybrid model's ``state_spec()`` (its class has ``state_spec`` and ``num_kv_layers``:
    the full-attention layers, which alone have K/V); None for a model without recurrent state.

    Raises:
        ValueError: ``num_kv_layers`` is not an int in ``1 .. arch.num_layers`` (named).
    """
    if not callable(getattr(model, "state_spec", None)):
        return None
    n = getattr(model, "num_kv_layers", None)
    if not isinstance(n, int) or not 1 <= n <= model.arch.num_layers:
        raise ValueError(f"{type(model).__name__}.num_kv_layers must be an int in 1..{model.arch.num_layers} "
                         f"(its full-attention layers), got {n!r}")
    return model.state_spec()


def num_state_snapshots(config: EngineConfig, model) -> int:
    """Snapshots the state-snapshot pool of a hybrid ``model`` holds: ``max_state_snapshots``
    when prefix caching can serve it (asked for, and a model class with
    ``supports_state_snapshots``; with ``kv_cache_dir`` the snapshots also go to disk beside
    their blocks), else 0 (no pool: prefix caching off for it)."""
    cache = config.cache_config
    on = cache.prefix_caching
    return cache.max_state_snapshots if on and getattr(model, "supports_state_snapshots", False) else 0


class ModelRunner:
    """Runs the decoder (and the vision tower) for the engine.

    Args:
        loaded: weights, config and tokenizer from ``load_model``.
        config: engine settings (cache kind, block size, budget).
        max_model_len: resolved tokens per request.

    A hybrid model (``hybrid_state_spec``) gets a ``StateCache`` of ``max_num_seqs`` slots
    (``state_cache``; None otherwise) under the same budget: state bytes first, KV blocks of
    its ``num_kv_layers`` layers from the rest; its steps run eager (``meta.state`` set). With
    prefix caching it also gets a ``StateSnapshotPool`` (``state_snapshots``, None otherwise;
    ``num_state_snapshots``), whose bytes come off the budget with the slots.

    With ``speculative="mtp"`` it also holds the MTP drafter (``drafter``, else None;
    ``spec_decode.mtp``): its layer's K/V are one more cache layer, every step runs eager, and
    ``run`` hands it each step's hidden states after sampling.

    Raises:
        KVBudgetError: the budget holds no block (or, contiguous, no strip), or not the state slots.
        ValueError: ``deterministic=True`` with a hybrid model; ``speculative="mtp"`` with a
            model or checkpoint without an MTP head (``spec_decode.mtp.build_drafter``).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int):
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not hardware.cpu_features().fast_bf16:
            log.warning("bfloat16 on this CPU (%s) is emulated through fp32 and slower than float32; "
                        "dtype='auto' picks float32 here", hardware.cpu_features().describe())
        pack = can_pack(self.dtype, self.device)  # CPU bf16: linear weights packed for oneDNN once
        self.num_packed_linears = pack_linears(self.model) if pack else 0
        self.mrope = self.model.arch.mrope_section is not None
        arch = self.model.arch
        cache, device_config = config.cache_config, config.device_config
        max_num_seqs = config.scheduler_config.max_num_seqs
        self.attention_backend = resolve_attention_backend(device_config.attention_backend, self.device, self.dtype,
                                                           arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                                           cache.kv_cache_dtype)
        state_spec = hybrid_state_spec(self.model)  # None: no recurrent-state layers
        self.deterministic = device_config.deterministic
        if self.deterministic and state_spec is not None:
            raise ValueError(f"deterministic=True does not serve hybrid models ({type(self.model).__name__}: "
                             "recurrent-state layers); run it with deterministic=False")
        if self.deterministic:  # layers/batch_invariant.py: fixed-row linears, every row through the C kernel
            self.attention_backend = enable_batch_invariance(self.model, config, self.device, self.dtype)
        self.vision = None  # built before the KV cache so the CUDA budget sees its weights
        if loaded.vision_state_dict is not None:
            from atlas_vlm.models.registry import import_named, resolve_family

            tower = import_named(resolve_family(loaded.hf_config).vision_tower)  # the family's tower class
            self.vision = tower.from_hf_config(loaded.hf_config, loaded.vision_state_dict,
                                               dtype=self.dtype, device=self.device)
            if pack:
                self.num_packed_linears += pack_linears(self.vision)
            if self.deterministic:
                tile_linears(self.vision)
        num_kv_layers = arch.num_layers if state_spec is None else self.model.num_kv_layers  # full attention only
        self.drafter = None  # speculative="mtp": the MTP head, its K/V one more cache layer
        if config.speculative_config.method == "mtp":
            from atlas_vlm.spec_decode import placeholder_token_ids
            from atlas_vlm.spec_decode.mtp import build_drafter

            self.drafter = build_drafter(self.model, config, num_kv_layers, str(config.model_config.model),
                                         placeholder_token_ids(loaded.hf_config))
            if pack:
                self.num_packed_linears += pack_linears(self.drafter.mtp)
            num_kv_layers += 1
        spec = kv_cache_spec(num_kv_layers, arch.num_kv_heads, arch.head_dim, self.dtype, cache.kv_cache_dtype)
        contiguous = cache.kv_cache == "contiguous"
        self.block_size = max_model_len if contiguous else cache.block_size
        from atlas_vlm.memory_plan import engine_max_pixels

        max_pixels = engine_max_pixels(config, loaded.image_settings)  # the checkpoint's, engine options over it
        budget = kv_cache_budget_bytes(config, self.device, loaded.hf_config, max_pixels)
        self.state_cache, state_bytes = None, 0  # hybrid: one state slot per running sequence, first
        self.state_snapshots = None  # hybrid + prefix caching: the state at block boundaries
        if state_spec is not None:
            snaps = num_state_snapshots(config, self.model)
            state_bytes = state_spec.bytes_per_seq * (max_num_seqs + snaps)
            if state_bytes > budget and cache.num_kvcache_blocks == -1:  # explicit blocks: no budget to share
                pool = f" + max_state_snapshots={snaps}" if snaps else ""
                raise KVBudgetError(
                    f"KV budget of {budget} bytes cannot hold the state slots of this hybrid model: "
                    f"max_num_seqs={max_num_seqs}{pool} x {state_spec.bytes_per_seq} bytes = {state_bytes} "
                    "bytes; raise kv_cache_memory / gpu_memory_utilization or lower max_num_seqs"
                    + (" / max_state_snapshots" if snaps else ""))
            self.state_cache = StateCache(state_spec, max_num_seqs, device=self.device)
            if snaps:
                self.state_snapshots = StateSnapshotPool(state_spec, snaps, cache.hybrid_snapshot_interval,
                                                         self.block_size, device=self.device)
            budget -= state_bytes
        num_blocks = cache.num_kvcache_blocks
        if num_blocks == -1:
            num_blocks = num_kv_blocks(budget, spec, self.block_size)
        if num_blocks < 1:
            unit = "strip" if contiguous else "block"
            after = f" (after {state_bytes} bytes of state slots)" if state_bytes else ""
            raise KVBudgetError(
                f"KV budget of {budget} bytes{after} is too small for one {unit} of {self.block_size} tokens "
                f"({spec.bytes_per_token * self.block_size} bytes); raise kv_cache_memory / "
                f"gpu_memory_utilization or lower {'max_model_len' if contiguous else 'kvcache_block_size'}"
            )
        if contiguous:
            self.kv_cache = ContiguousKVCache(spec, num_blocks, max_model_len, device=self.device)
        else:
            self.kv_cache = PagedKVCache(spec, num_blocks, self.block_size, device=self.device)
        self.num_blocks = num_blocks
        from atlas_vlm.worker.compiled_decode import CompiledDecode, resolve_compile_decode

        on, self.compile_decode_reason = resolve_compile_decode(device_config.compile_decode, self.device,
                                                                cache.kv_cache_dtype)
        if state_spec is not None:  # the fast decode paths carry no state slots: eager runs hybrids
            on, self.compile_decode_reason = False, "hybrid model (recurrent-state layers): decode runs eager"
        if self.drafter is not None:  # the drafter reads every step's hidden states: eager keeps them
            on, self.compile_decode_reason = False, "speculative='mtp': every step runs eager"
        compiled = CompiledDecode(
            self.model, self.kv_cache, self.block_size, max_model_len, max_num_seqs, self.mrope,
            use_kernel=self.attention_backend == "decode_kernel") if on else None  # None: eager decode
        from atlas_vlm.worker.decode_step import DecodeStep

        # quantized models on CPU: decode-only steps through every layer in one C call (None: op by op)
        c_step, self.decode_step_reason = DecodeStep.build(self.model, self.kv_cache, self.attention_backend) \
            if self.device.type == "cpu" and state_spec is None else \
            (None, "CPU only" if state_spec is None else "hybrid model (recurrent-state layers)")
        if self.drafter is not None:
            c_step, self.decode_step_reason = None, "speculative='mtp': every step runs eager"
        # the step executors, asked in order; the first that serves a step runs it (eager serves all)
        self.executors: list = []
        self.compiled_decode, self.decode_step = compiled, c_step
        self.executor_steps: Counter[str] = Counter()  # executor name -> steps it ran
        # content hash -> encoder rows [num_tokens, columns]; the scheduler's EncoderCacheManager says
        # what to encode and what to drop (SchedulerOutput.encoder_inputs / freed_encoder_hashes)
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self.num_encoder_runs = 0  # media items encoded (one per item not found in the cache)
        self.last_step: StepInputs | None = None  # with the drafter: the latest step (inputs, hidden states)
        # Called after each forward as observer(chunks, inputs, logits, sampled), before any
        # request state moves on and before sampling (a test may write into ``logits`` to
        # inject a fault): how tests and benchmarks watch steps without patching methods.
        self.observers: list[Callable[[list, ModelInput, torch.Tensor, list[int]], None]] = []

    @torch.inference_mode()
    def encode(self, encoder_inputs: dict | None = None, freed_encoder_hashes=()) -> None:
        """Drop the rows of ``freed_encoder_hashes``, then encode ``encoder_inputs`` (content
        hash -> media item) in one tower call and keep each item's rows ``[num_tokens,
        columns]`` (Qwen3-VL: with its DeepStack columns) under its hash. Never touches a
        request.

        Raises:
            ValueError: media sent to a model without a vision tower.
        """
        self.drop_encoder_outputs(freed_encoder_hashes)
        missing = [(h, item) for h, item in (encoder_inputs or {}).items() if h not in self.encoder_outputs]
        if not missing:
            return
        if self.vision is None:
            raise ValueError(f"this model has no vision tower; it cannot take {missing[0][1].modality} input")
        for (content_hash, _), rows in zip(missing, self.vision.encode([item for _, item in missing])):
            self.encoder_outputs[content_hash] = rows
            self.num_encoder_runs += 1

    def drop_encoder_outputs(self, content_hashes) -> None:
        """Forget the rows of these content hashes (evicted by the ``EncoderCacheManager``)."""
        for content_hash in content_hashes:
            self.encoder_outputs.pop(content_hash, None)

    def _executor(self, name: str):
        return next((e.impl for e in self.executors if e.name == name), None)

    def _set_executors(self, compiled, c_step) -> None:
        self.executors = [*([CompiledDecodeExecutor(compiled)] if compiled is not None else []),
                          *([DecodeStepExecutor(c_step)] if c_step is not None else []), EagerExecutor()]

    @property
    def compiled_decode(self):
        """The compiled decode (``worker.compiled_decode.CompiledDecode``), or None where decode
        runs eager; setting None takes its executor out."""
        return self._executor("compiled")

    @compiled_decode.setter
    def compiled_decode(self, impl) -> None:
        self._set_executors(impl, self.decode_step)

    @property
    def decode_step(self):
        """The one-call C decode step (``worker.decode_step.DecodeStep``), or None where decode
        steps run op by op (``decode_step_reason`` says why); setting None takes it out."""
        return self._executor("decode_step")

    @decode_step.setter
    def decode_step(self, impl) -> None:
        self._set_executors(self.compiled_decode, impl)

    @torch.inference_mode()
    def forward_logits(self, chunks) -> tuple[torch.Tensor, list[int]]:
        """One batched forward through the first executor that serves it (the eager one when a
        pooling request is in the step). Returns fp32 logits ``[num_sampled, vocab]`` of the
        chunks that reach their request's end (pooling requests' excluded: their
        ``embedding`` is set instead, ``worker.pooler``), and those chunks' indices."""
        step = StepInputs(self, chunks)
        if self.drafter is not None:
            self.last_step = step  # its inputs and hidden states: the MTP drafter reads them after sampling
        pooling = any(getattr(req, "pooling_params", None) is not None for req, _ in chunks)
        eager = pooling or self.drafter is not None
        executors = [e for e in self.executors if e.name == "eager"] if eager else self.executors
        for executor in executors:  # pooling / the drafter need the hidden states: only the eager one keeps them
            logits = executor.run(step)
            if logits is not None:
                break
        self.executor_steps[executor.name] += 1
        if pooling:
            pool_step(chunks, step.hidden)
        inp = step.inp
        for observe in self.observers:
            observe(chunks, inp, logits, inp.sampled)
        return logits, inp.sampled

    def run(self, chunks, grammar_bitmask=None, encoder_inputs: dict | None = None,
            freed_encoder_hashes=()) -> tuple[list[int], SamplerOutput]:
        """Encoding (``encode``: the step's ``encoder_inputs`` and ``freed_encoder_hashes``
        from the ``SchedulerOutput``), forward plus sampling: the indices of the chunks that
        sampled a token (row order) and the sampler's per-row tokens, logprobs and errors.
        ``grammar_bitmask`` (``structured_output.GrammarBitmask`` or None) constrains the rows
        of its requests.
        A request with ``k`` speculative drafts has ``k + 1`` consecutive rows (greedy: argmax
        each; sampled: ``spec_decode.rejection``)."""
        self.encode(encoder_inputs, freed_encoder_hashes)
        logits, sampled = self.forward_logits(chunks)
        reqs = [chunks[i][0] for i in sampled]
        masks = None
        if grammar_bitmask is not None:  # a drafted request's k + 1 rows: k + 1 masks in a row
            pos, first = {}, {}
            for k, rid in enumerate(grammar_bitmask.request_ids):
                pos.setdefault(rid, k)
            for j, r in enumerate(reqs):
                first.setdefault(r.request_id, j)
            rows = [j for j, r in enumerate(reqs) if r.request_id in pos]
            masks = (rows, grammar_bitmask.bitmask[[pos[reqs[j].request_id] + j - first[reqs[j].request_id]
                                                    for j in rows]])
        out = sample_with_drafts(logits, reqs, masks)
        if self.drafter is not None:  # MTP drafts for the next step, from this step's hidden states
            step, self.last_step = self.last_step, None
            self.drafter.after_step(chunks, step.inp, step.hidden, sampled, out, self.kv_cache, step.prepared[1])
        return sampled, out
