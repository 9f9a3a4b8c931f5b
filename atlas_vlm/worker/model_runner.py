"""``ModelRunner``: owns the model weights, the KV cache and the vision tower, and runs one
batched forward per engine step. Scheduling and stopping rules live elsewhere."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from atlas_vlm.config import EngineConfig
from atlas_vlm.worker.input_prep import ModelInput, prepare_inputs
from atlas_vlm.loader import LoadedModel
from atlas_vlm.worker.sampler import sample
from mm_kv_cache_management import ContiguousKVCache, KVCacheSpec, PagedKVCache


class KVBudgetError(ValueError):
    """The KV memory budget cannot hold a single block."""


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes the KV cache may take: ``kv_cache_memory`` on CPU; on CUDA
    ``gpu_memory_utilization`` of the device minus what is already allocated (weights) and a
    reserve for activations of one ``max_num_batched_tokens`` step."""
    if device.type != "cuda":
        return config.kv_cache_memory
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    activation_reserve = 512 * 2**20
    return max(0, int(total * config.gpu_memory_utilization) - used - activation_reserve)


class ModelRunner:
    """Runs the decoder (and the vision tower) for the engine.

    Args:
        loaded: weights, config and tokenizer from ``load_model``.
        config: engine settings (cache kind, block size, budget).
        max_model_len: resolved tokens per request.

    Raises:
        KVBudgetError: the budget holds no block (or, contiguous, no strip).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int):
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.mrope = self.model.arch.mrope_section is not None
        arch = self.model.arch
        spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, self.dtype)
        contiguous = config.kv_cache == "contiguous"
        self.block_size = max_model_len if contiguous else config.kvcache_block_size
        budget = kv_cache_budget_bytes(config, self.device)
        num_blocks = config.num_kvcache_blocks
        if num_blocks == -1:
            num_blocks = PagedKVCache.num_blocks_for_budget(budget, spec, self.block_size)
        if num_blocks < 1:
            unit = "strip" if contiguous else "block"
            raise KVBudgetError(
                f"KV budget of {budget} bytes is too small for one {unit} of {self.block_size} tokens "
                f"({spec.bytes_per_token * self.block_size} bytes); raise kv_cache_memory / "
                f"gpu_memory_utilization or lower {'max_model_len' if contiguous else 'kvcache_block_size'}"
            )
        if contiguous:
            self.kv_cache = ContiguousKVCache(spec, num_blocks, max_model_len, device=self.device)
        else:
            self.kv_cache = PagedKVCache(spec, num_blocks, self.block_size, device=self.device)
        self.num_blocks = num_blocks
        self.vision = None
        if loaded.vision_state_dict is not None:
            from mm_token_pipeline.towers import build_vision_encoder  # models-vl (issue 9): per family

            self.vision = build_vision_encoder(loaded.hf_config, loaded.vision_state_dict,
                                               dtype=self.dtype, device=self.device)
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # image hash -> embeddings
        self.encoder_cache_size = 64  # images kept
        self.num_encoder_runs = 0  # vision-tower forwards (one per image not found in the cache)
        # Called after each forward as observer(chunks, inputs, logits, sampled), before any
        # request state moves on: how tests and benchmarks watch steps without patching methods.
        self.observers: list[Callable[[list, ModelInput, torch.Tensor, list[int]], None]] = []

    @torch.inference_mode()
    def encode_images(self, req) -> None:
        """Fill ``req.image_embeds``: per image ``[num_tokens, hidden]`` (Qwen3-VL: with its
        DeepStack columns), reusing cached images. An image whose tokens are all computed
        already (a prefix-cache hit covering it) needs no features and stays ``None`` until
        a recompute (preemption) reaches it again (models-vl branch, issue 9)."""
        if not req.images:
            return
        embeds = list(req.image_embeds) if req.image_embeds is not None else [None] * len(req.images)
        needed = [i for i, (span, emb) in enumerate(zip(req.image_spans, embeds))
                  if emb is None and span.offset + span.length > req.num_computed_tokens]
        missing = list({req.images[i].content_hash: req.images[i] for i in needed
                        if req.images[i].content_hash not in self.encoder_cache}.values())
        if missing:
            if self.vision is None:
                raise ValueError("this model has no vision tower; it cannot take images")
            for img, emb in zip(missing, self.vision.encode_images(missing)):
                self.encoder_cache[img.content_hash] = emb
                self.num_encoder_runs += 1
        for i in needed:
            self.encoder_cache.move_to_end(req.images[i].content_hash)
            embeds[i] = self.encoder_cache[req.images[i].content_hash]
        req.image_embeds = embeds
        while len(self.encoder_cache) > self.encoder_cache_size:
            self.encoder_cache.popitem(last=False)

    @torch.inference_mode()
    def forward_logits(self, chunks) -> tuple[torch.Tensor, list[int]]:
        """One batched forward. Returns fp32 logits ``[num_sampled, vocab]`` of the chunks
        that reach their request's end, and those chunks' indices."""
        for req, _ in chunks:
            self.encode_images(req)
        inp = prepare_inputs(chunks, self.device, self.mrope)
        x = self.model.embed(inp.input_ids, inp.mm_embeds, inp.mm_token_index)  # [num_tokens, hidden]
        # Qwen3-VL's DeepStack adds image rows inside the decoder (models-vl branch, issue 9)
        mm = dict(mm_embeds=inp.mm_embeds, mm_token_index=inp.mm_token_index) \
            if getattr(self.model, "takes_mm_in_forward", False) else {}
        hidden = self.model(x, inp.positions, self.kv_cache, inp.meta, **mm)
        logits = self.model.compute_logits(hidden[inp.logits_index])  # [num_sampled, vocab]
        for observe in self.observers:
            observe(chunks, inp, logits, inp.sampled)
        return logits, inp.sampled

    def run(self, chunks):
        """Forward plus sampling: ``[(chunk index, token id, logprob, top logprobs)]``."""
        logits, sampled = self.forward_logits(chunks)
        reqs = [chunks[i][0] for i in sampled]
        tokens, logprobs, tops = sample(logits, reqs)
        return list(zip(sampled, tokens, logprobs, tops))
