"""Step executors: the ways one engine step's forward can run, behind one interface.

``ModelRunner.forward_logits`` asks its executors in order (the first that serves a step
runs it) instead of branching on each fast path:

- ``CompiledDecodeExecutor``: decode-only batches through a captured graph
  (``worker.compiled_decode``; CUDA graphs / ``torch.compile`` where resolved on);
- ``DecodeStepExecutor``: decode-only steps (speculative verification rows included) of
  quantized models on CPU through every decoder layer in one C call (``worker.decode_step``;
  the op-by-op bits);
- ``EagerExecutor``: any step, layer by layer (the reference every other one is tested against);
  the only one that keeps the step's final hidden states (``StepInputs.hidden``), so a step
  with a pooling request (``PoolingParams``) runs through it.

An executor's ``run(step)`` returns fp32 logits ``[num_sampled, vocab]`` or ``None`` (this step
is not one it serves). ``StepInputs`` prepares the eager inputs once, only when an executor
asks for them.
"""

from __future__ import annotations

from functools import cached_property

import torch

from atlas_vlm.worker.input_prep import ModelInput, prepare_inputs


class StepInputs:
    """One step's chunks (``[(request, num_tokens)]``) and, on first use, its prepared inputs.

    ``inp`` is set by whichever executor ran the step (the compiled one builds its own), so
    observers see the input that produced the logits."""

    def __init__(self, runner, chunks):
        self.runner, self.chunks = runner, chunks
        self.inp: ModelInput | None = None
        self.hidden: torch.Tensor | None = None  # final hidden states, set by the eager executor

    @cached_property
    def prepared(self) -> tuple[ModelInput, torch.Tensor, dict]:
        """``(inp, x, mm)``: the batch's ``ModelInput`` (media rows from the runner's
        ``encoder_outputs``, by content hash), input embeddings ``x`` ``[num_tokens, hidden]`` and the decoder's extra
        keyword arguments (Qwen3-VL's DeepStack rows)."""
        r = self.runner
        snapshots = r.state_snapshots
        inp = prepare_inputs(self.chunks, r.device, r.mrope, r.attention_backend, r.state_cache,
                             encoder_outputs=r.encoder_outputs,
                             snapshot_cache=snapshots.storage if snapshots is not None else None)
        x = r.model.embed(inp.input_ids, inp.mm_embeds, inp.mm_token_index)  # [num_tokens, hidden]
        mm = dict(mm_embeds=inp.mm_embeds, mm_token_index=inp.mm_token_index) \
            if r.capabilities.multimodal_in_forward else {}
        if r.lora is not None:  # each row's adapter slot, grouped for the wrapped projections
            inp.lora_slots = r.lora.set_step(self.chunks, r.device)
        self.inp = inp
        return inp, x, mm


class CompiledDecodeExecutor:
    """Decode-only steps through ``worker.compiled_decode.CompiledDecode`` (``impl``)."""

    name = "compiled"

    def __init__(self, impl):
        self.impl = impl

    def run(self, step: StepInputs) -> torch.Tensor | None:
        if not self.impl.applies(step.chunks, step.runner.capabilities.multimodal_in_forward):
            return None
        logits = self.impl.run(step.chunks)  # None: a shape it has no graph for
        if logits is not None:
            step.inp = self.impl.model_input(step.chunks)
        return logits


class DecodeStepExecutor:
    """Decode-only steps of quantized CPU models in one C call (``worker.decode_step.DecodeStep``
    or any object with its ``applies`` / ``__call__``, as ``impl``)."""

    name = "decode_step"

    def __init__(self, impl):
        self.impl = impl

    def run(self, step: StepInputs) -> torch.Tensor | None:
        inp, x, _ = step.prepared
        if not self.impl.applies(inp.meta, x.shape[0], inp.mm_embeds is not None):
            return None
        cos, sin = step.runner.model.model.rotary(inp.positions, x.dtype)
        hidden, logits = self.impl(x, cos, sin, inp.meta)  # every layer in one call, the same bits
        if logits is None:
            return step.runner.model.compute_logits(hidden[inp.logits_index])  # [num_sampled, vocab]
        # every row's logits: keep the sampled ones (a one-token chunk of a prompt samples nothing)
        return logits if inp.logits_index.numel() == logits.shape[0] else logits[inp.logits_index]


class EagerExecutor:
    """Any step, layer by layer through the model's modules."""

    name = "eager"

    def run(self, step: StepInputs) -> torch.Tensor:
        inp, x, mm = step.prepared
        hidden = step.runner.model(x, inp.positions, step.runner.kv_cache, inp.meta, **mm)
        step.hidden = hidden  # [num_tokens, hidden], for the pooling requests of the step
        return step.runner.model.compute_logits(hidden[inp.logits_index])  # [num_sampled, vocab]
