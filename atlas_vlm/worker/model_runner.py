"""``ModelRunner``: owns the model weights, the KV cache, the vision tower and its encoder
outputs (rows by content hash, which the scheduler's ``EncoderCacheManager`` decides), and runs
one batched forward per engine step. Scheduling and stopping rules live elsewhere."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from atlas_vlm.config import EngineConfig
from atlas_vlm.worker import runner_build
from atlas_vlm.worker.input_prep import ModelInput
from atlas_vlm.worker.step_executors import (CompiledDecodeExecutor, DecodeStepExecutor, EagerExecutor,
                                             StepInputs)
from atlas_vlm.loader import LoadedModel
from atlas_vlm.worker.pooler import pool_step
from atlas_vlm.worker.sampler import SamplerOutput
from atlas_vlm.spec_decode.rejection import sample_with_drafts  # worker.sampler.sample unless a sampled row has drafts

if TYPE_CHECKING:  # the plan is built above this floor (engine.assembly) and handed down
    from atlas_vlm.engine.plan import EnginePlan


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


class ModelRunner:
    """Runs the decoder (and the vision tower) for the engine, built as the plan says
    (``engine.plan.EnginePlan``; the pieces: ``worker.runner_build``).

    Args:
        loaded: weights, config and tokenizer from ``load_model``.
        config: engine settings (``cache_config.hybrid_snapshot_interval``, ``max_num_seqs``).
        plan: the engine plan (attention backend, KV spec and blocks, state, drafter, decode paths).
        vision: the vision tower (``runner_build.load_vision_tower``), or None.

    A hybrid model gets a ``StateCache`` of ``max_num_seqs`` slots (``state_cache``; None
    otherwise), its bytes off the KV budget first; its steps run eager (``meta.state`` set).
    With prefix caching it also gets a ``StateSnapshotPool`` (``state_snapshots``, None
    otherwise). With ``speculative="mtp"`` it also holds the MTP drafter (``drafter``, else
    None; ``spec_decode.mtp``): its layer's K/V are one more cache layer, every step runs
    eager, and ``run`` hands it each step's hidden states after sampling.

    Raises:
        ValueError: ``speculative="mtp"`` with a checkpoint without the MTP weights
            (``models.qwen3_5.mtp.build_mtp``). Every other refusal is the plan's.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, plan: EnginePlan, vision=None):
        self.model, self.vision, self.plan = loaded.model, vision, plan
        self.capabilities = self.model.capabilities()  # what the model class declares
        self.pooled: dict[str, list[float]] = {}  # the step's embeddings, until run() hands them out
        self.device, self.dtype, self.deterministic = plan.device, plan.dtype, plan.deterministic
        self.mrope = self.model.arch.mrope_section is not None
        self.attention_backend = plan.attention_backend.value
        self.num_packed_linears = runner_build.prepare_weights(self.model, vision, plan)
        self.lora = runner_build.build_lora(self.model, plan)  # enable_lora: the adapter slots (atlas_vlm.lora)
        self.block_size, self.num_blocks = plan.kv.block_size, plan.num_blocks.value
        self.kv_cache = runner_build.build_kv_cache(plan)
        # hybrid models: one state slot per running sequence, and the state at block boundaries
        self.state_cache, self.state_snapshots = runner_build.build_state(
            plan, config.cache_config.hybrid_snapshot_interval)
        self.drafter, packed = runner_build.build_drafter(loaded, config, plan)  # speculative="mtp": the MTP head
        self.num_packed_linears += packed
        compiled, self.compile_decode_reason, c_step, self.decode_step_reason = runner_build.build_decode_paths(
            self.model, self.kv_cache, plan, config.scheduler_config.max_num_seqs, self.mrope)
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
        chunks that reach their request's end (pooling requests' excluded: their embeddings
        go out through ``run``'s ``SamplerOutput.pooled``, ``worker.pooler``), and those
        chunks' indices."""
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
        self.pooled = pool_step(chunks, step.hidden) if pooling else {}  # run() hands them out with the step
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
        out.pooled, self.pooled = self.pooled, {}
        if self.drafter is not None:  # MTP drafts for the next step, from this step's hidden states
            step, self.last_step = self.last_step, None
            self.drafter.after_step(chunks, step.inp, step.hidden, sampled, out, self.kv_cache, step.prepared[1])
        return sampled, out
