"""KV memory planner: what a model needs on a GPU, from ``config.json`` alone (no weights).

One source of truth for KV sizing: the engine's ``ModelRunner`` calls ``kv_cache_budget``,
``kv_cache_spec`` and ``num_kv_blocks`` below with measured figures; ``plan`` calls them
with figures computed from the config. Figures, for a dtype of ``b`` bytes:

- weights: ``(text_params + vision_params) * b`` (``models.param_count``, exact HF counts);
  with ``quantization`` the decoder projections at that scheme's bytes
  (``atlas_vlm.quantization.sizes``: int8 ``N K + N b``, int4 ``N K / 2 + 2 (K / g) N b``).
- KV per token: ``2 (K, V) * num_layers * num_kv_heads * head_dim * b``
  (``KVCacheSpec.bytes_per_token``); per block: that times ``kvcache_block_size``. A hybrid
  model (``layer_types`` with ``"linear_attention"``: Qwen3.5) counts its full-attention layers
  only, and its state slots (``StateSpec.bytes_per_seq`` fp32 bytes per sequence, independent
  of length; ``mm_kv_cache_management.state_spec_from_config``) take ``max_num_seqs`` of them
  off the budget first, as the engine allocates them, and its state snapshots (prefix caching:
  ``max_state_snapshots`` more of the same size, ``state_snapshots.py``) with them.
- vision activation peak at ``max_pixels``: see ``vision_activation_peak``.
- KV budget (CUDA, ``num_kvcache_blocks=-1``): ``int(total * gpu_memory_utilization)``
  minus what is in use (weights + ``RUNTIME_OVERHEAD_BYTES``, measured by the engine) minus
  the activation reserve (``ACTIVATION_RESERVE_BYTES`` + the vision peak); blocks: the
  budget floor-divided by the bytes of one block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from atlas_vlm.models.param_count import head_dim, num_kv_heads, text_config, text_params, vision_params
from atlas_vlm.models.registry import vision_hooks
from mm_kv_cache_management import KVCacheSpec, PagedKVCache, state_spec_from_config
from mm_kv_cache_management.state_config import num_full_attention_layers

GiB = 1 << 30
ACTIVATION_RESERVE_BYTES = 512 << 20  # decoder activations of one engine step (the engine's reserve)
RUNTIME_OVERHEAD_BYTES = 512 << 20  # CUDA context + allocator slack: an estimate (the engine measures it)
VISION_PEAK_FACTOR = 2  # measured peak / live-tensor sum of a ViT forward, rounded up (vision_activation_peak)
# the engine's --dtype names (and short aliases); "auto" is bf16 on a GPU (fp16 where it lacks bf16): 2 bytes
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}
IMAGE_SHARE_OF_L = 0.75  # the largest usable image leaves a quarter of L for the prompt's text and the reply
TORCH_DTYPES = {2: torch.bfloat16, 4: torch.float32}


def kv_cache_spec(num_layers: int, num_kv_heads_: int, head_dim_: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """The KV shape of one token (``bytes_per_token`` = 2 * layers * kv_heads * head_dim * elem,
    plus a 2-byte scale per head with an 8-bit ``kv_cache_dtype``)."""
    return KVCacheSpec(num_layers, num_kv_heads_, head_dim_, dtype, kv_cache_dtype)


def num_kv_blocks(budget_bytes: int, spec: KVCacheSpec, block_size: int) -> int:
    """Whole blocks of ``block_size`` tokens in ``budget_bytes`` (``PagedKVCache.num_blocks_for_budget``)."""
    return PagedKVCache.num_blocks_for_budget(max(0, int(budget_bytes)), spec, block_size)


def kv_cache_budget(total_bytes: int, gpu_memory_utilization: float, used_bytes: int, reserve_bytes: int) -> int:
    """KV bytes on a device of ``total_bytes``: ``int(total * utilization) - used - reserve``, at least 0."""
    return max(0, int(total_bytes * gpu_memory_utilization) - int(used_bytes) - int(reserve_bytes))


def visual_tokens_per_image(hf_config, max_pixels: int) -> int:
    """Most visual tokens one image can take at ``max_pixels`` (the family's
    ``FamilyHooks.visual_tokens_per_image``).

    Qwen2-VL / 2.5-VL / 3-VL: ``max_pixels // (patch_size * spatial_merge_size)**2``
    (``smart_resize`` keeps ``h * w <= max_pixels`` on multiples of that factor).
    SmolVLM (Idefics3 processor): a square of side ``min(sqrt(max_pixels), size.longest_edge)``
    is cut into ``ceil(side / tile)**2`` tiles of ``tile = max_image_size.longest_edge`` pixels
    plus one global view when there is more than one tile; each tile gives
    ``(image_size // patch_size)**2 // scale_factor**2`` tokens.
    """
    return vision_hooks(hf_config).visual_tokens_per_image(hf_config, max_pixels)


def largest_image_pixels(hf_config, max_tokens: int) -> int:
    """The largest ``max_pixels`` whose image takes at most ``max_tokens`` visual tokens
    (0 if not even the smallest does): Qwen families ``max_tokens * (patch_size *
    spatial_merge_size)**2`` (a multiple of that patch area, e.g. 28x28 = 784 pixels for
    Qwen2.5-VL); SmolVLM the largest ``(n * tile)**2`` square of ``n x n`` tiles (plus the
    global view) that fits (``visual_tokens_per_image``'s rules inverted)."""
    return vision_hooks(hf_config).largest_image_pixels(hf_config, max_tokens)


def video_tokens_per_clip(hf_config, seconds: float, video_sampling: dict | None = None, *,
                          fps: float | None = None, max_frames: int | None = None,
                          nframes: int | None = None) -> tuple[int, int, int]:
    """``(frames, pixels per frame, visual tokens)`` of the largest clip of ``seconds``
    seconds, with each family's default sampling; ``(0, 0, 0)`` where none is stated.
    ``fps`` / ``max_frames`` / ``nframes``: a video item's own options (as the engine takes
    them in a chat message), over the family's defaults; ``nframes`` wins over ``fps``.

    Qwen2-VL / 2.5-VL / 3-VL (qwen-vl-utils 0.0.14, as the engine samples): frames by
    ``smart_nframes`` at fps 2 (a 30 fps source assumed; at least 4, an even count), each
    frame at most ``video_frame_bounds(...).max_pixels`` (768 tokens a frame group, less
    under the 128000-token ``total_pixels`` default); tokens ``frames / temporal_patch_size
    * max_pixels // (patch_size * spatial_merge_size)**2``. SmolVLM2 (HF
    ``SmolVLMVideoProcessor``): ``min(round(fps * seconds), max_frames)`` frames from the
    checkpoint's ``video_sampling``, each one ``max_image_size`` square of one tile's tokens;
    without a ``video_sampling`` the count is not stated (zeros).
    """
    return vision_hooks(hf_config).video_tokens_per_clip(hf_config, seconds, video_sampling, fps=fps,
                                                          max_frames=max_frames, nframes=nframes)


def engine_max_pixels(config, image_settings) -> int | None:
    """The bound the engine sizes its vision reserve for: ``MultiModalConfig.image_bounds`` over
    the checkpoint's ``image_settings`` (its ``max_pixels`` where the config sets none; None
    for a text-only model). ``plan`` with ``max_pixels=None`` takes the same value."""
    if image_settings is None:
        return None
    return config.multimodal_config.image_bounds(image_settings).max_pixels or image_settings.max_pixels


def vision_activation_peak(hf_config, max_pixels: int, dtype_bytes: int) -> int:
    """Estimated peak activation bytes of the vision tower on one image of ``max_pixels``.

    ``N`` patches (Qwen: ``max_pixels // patch_size**2``; SmolVLM: tiles * patches per
    tile) of width ``d`` with MLP width ``I``: the tensors live at once inside one ViT block
    are taken as the residual stream, its normed copy, q/k/v (3d) and the MLP's two
    ``I``-wide tensors (gate and up for Qwen2.5-VL's gated MLP; fc1 output and its
    activation otherwise): ``N * (5 d + 2 I) * dtype_bytes``, times ``VISION_PEAK_FACTOR``
    (2) for allocator workspace and short-lived temporaries. Calibration (CPU, fp32, the
    real-width Qwen2.5-VL-3B tower with random weights, peak RSS growth of the forward,
    ``benchmarks/vision_peak.py``): 64x80 patches: 401 MB (depth 2) and 462 MB (depth 1)
    against a 271 MB live-tensor sum; 70x70 patches: 517 MB against 260 MB (519 MB
    planned). So the factor sits at the top of the measured 1.5-2.0 range, with no margin
    beyond it. Not measured on CUDA. Assumption: attention runs
    through fused SDPA (flash / memory-efficient: transformers' default ``sdpa``), which
    never materialises the ``[heads, N, N]`` score matrix; eager attention would add
    ``2 * heads * N**2 * dtype_bytes``. Source: the block structure of HF
    ``Qwen2_5_VLVisionBlock`` / ``Qwen3VLVisionBlock`` / ``SmolVLMEncoderLayer``.
    """
    if getattr(hf_config, "vision_config", None) is None:
        return 0
    n, d, inter = vision_hooks(hf_config).vision_activation_shape(hf_config, max_pixels)
    return VISION_PEAK_FACTOR * n * (5 * d + 2 * inter) * dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """What ``plan`` computed (bytes unless named otherwise)."""

    model: str
    dtype_bytes: int
    weight_bytes: int  # text + vision parameters * dtype_bytes
    vision_weight_bytes: int
    vision_peak_bytes: int  # vision_activation_peak at max_pixels
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    block_size: int
    gpu_memory: int
    gpu_memory_utilization: float
    kv_budget_bytes: int
    num_blocks: int  # what num_kvcache_blocks=-1 gets
    max_model_len: int  # L: tokens of one sequence (prompt with its image + output)
    max_pixels: int  # 0 for a text-only model
    image_tokens: int  # visual tokens of one image at max_pixels (0: text-only model)
    max_num_seqs: int  # sequences of L tokens (each with one image) held at once; 0 if L < image_tokens
    pixels_source: str = ""  # where max_pixels came from ("max_pixels=" or the checkpoint's settings)
    video_seconds: float = 0.0  # the planned clip's length (video_tokens_per_clip)
    video_frames: int = 0  # frames sampled from it (0: no video, or none stated)
    video_frame_pixels: int = 0  # pixels of each frame at most
    video_tokens: int = 0  # visual tokens of the clip

    @property
    def fits(self) -> bool:
        """At least one sequence of L tokens (with its image) fits."""
        return self.max_num_seqs > 0

    def why_not(self) -> str | None:
        """Why no sequence fits (None when one does), in a user's terms."""
        if self.kv_budget_bytes == 0 or self.num_blocks == 0:
            state = f", {self.state_bytes / GiB:.2f} GiB of state slots (--max-num-seqs)" if self.state_slots else ""
            state += f", {self.snapshot_bytes / GiB:.2f} GiB of state snapshots" if self.state_snapshots else ""
            return (f"does not fit: {self.gpu_memory / GiB:.2f} GiB x {self.gpu_memory_utilization} holds no KV block "
                    f"after {self.weight_bytes / GiB:.2f} GiB of weights{state} and the activation reserve "
                    "(a larger GPU, a smaller dtype or a smaller model)")
        if self.max_model_len < self.image_tokens:
            return (f"does not fit: one image at max_pixels={self.max_pixels:,} is {self.image_tokens:,} visual "
                    f"tokens, more than L={self.max_model_len:,} (raise --max-model-len or lower --max-pixels; "
                    f"the largest usable image is max_pixels={self.usable_max_pixels:,})")
        if self.max_num_seqs == 0:
            return f"does not fit: {self.num_blocks} blocks hold less than one sequence of L={self.max_model_len:,}"
        return None
    quantization: str | None = None  # the decoder projections' scheme (None: dense)
    usable_max_pixels: int = 0  # largest image <= max_pixels within IMAGE_SHARE_OF_L of L (0: text-only / none)
    note: str = ""  # what the caller changed (plan_model: planned at usable_max_pixels), for the user
    bound_image_tokens: int = 0  # then: visual tokens of one image at the checkpoint's own bound (over L)
    kv_cache_dtype: str = "auto"  # K/V storage ("int8" / "fp8_e4m3": 8-bit codes + a 2-byte scale per head)
    state_bytes_per_seq: int = 0  # hybrid models: recurrent state of one sequence (any length); 0 otherwise
    state_slots: int = 0  # hybrid models: state slots allocated (the engine's max_num_seqs)
    state_snapshots: int = 0  # hybrid models: snapshots of the prefix cache (max_state_snapshots)

    @property
    def state_bytes(self) -> int:
        """Bytes of all state slots, taken off ``kv_budget_bytes`` before the blocks."""
        return self.state_bytes_per_seq * self.state_slots

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the state-snapshot pool (hybrid prefix caching), off the budget with the slots."""
        return self.state_bytes_per_seq * self.state_snapshots

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_num_video_seqs(self) -> int:
        """Sequences of L tokens, each with one planned clip, held at once (0: the clip is over L)."""
        if not self.video_tokens or self.video_tokens >= self.max_model_len:
            return 0
        return self.num_blocks // self.blocks_per_seq


@dataclass(frozen=True)
class PlanOptions:
    """What ``plan`` plans for: the engine options that size memory, and the device.

    Attributes:
        model: the name shown in the plan.
        gpu_memory: bytes of the device; ``gpu_memory_utilization``: the engine's fraction of it.
        max_model_len: L; ``None``: ``min(max_position_embeddings, 4096)`` as the engine.
        max_pixels: the one image's bound; ``None``: the checkpoint's, as the engine takes it
            (``image_settings``, i.e. ``models.processor_settings.image_processor_settings`` of the
            folder; the family's released defaults when that is None too).
        dtype: a key of ``DTYPE_BYTES``; ``block_size``: the engine's ``kvcache_block_size``.
        quantization: None (dense) or "int8" / "int4" / "awq" / "gptq": the decoder's
            projections at that scheme's bytes (``quantization.sizes``); the rest dense.
        video_seconds: the planned clip (``video_tokens_per_clip``); ``video_sampling``: a
            SmolVLM2 checkpoint's ``video_sampling`` (its processor config), if any;
            ``video_fps`` / ``video_max_frames`` / ``video_frames``: the clip's own options.
        kv_cache_dtype: the engine's K/V storage ("auto": ``dtype``; "int8" / "fp8_e4m3": one
            byte per element plus a 2-byte scale per token and KV head).
        max_num_seqs: the engine's ``max_num_seqs`` (its default, 64): a hybrid model's state
            slots; its sequences held at once are at most that many.
        max_state_snapshots: the engine's (default 16; 0: prefix caching off): a hybrid model's
            state-snapshot pool, ``max_state_snapshots`` sequences' state more.
    """

    model: str = ""
    gpu_memory: int = 24 * GiB
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_pixels: int | None = None
    dtype: str = "bf16"
    block_size: int = 16
    image_settings: object = None
    quantization: str | None = None
    video_seconds: float = 10.0
    video_sampling: dict | None = None
    video_fps: float | None = None
    video_max_frames: int | None = None
    video_frames: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_state_snapshots: int = 16


def plan(hf_config, options: PlanOptions | None = None, **overrides) -> MemoryPlan:
    """Plan one model on one GPU (see the module docstring for every formula).

    Args:
        hf_config: a transformers config (``AutoConfig.from_pretrained(folder)``).
        options: a ``PlanOptions`` (None: its defaults); ``overrides``: its fields by name,
            over it (``plan(cfg, dtype="fp32")``).

    Raises:
        ValueError: unknown ``dtype`` or ``quantization``, or a vision tower without a formula.
        TypeError: an override that is not a ``PlanOptions`` field.
    """
    from atlas_vlm.quantization.sizes import text_weight_bytes

    o = replace(options or PlanOptions(), **overrides)
    dtype, max_pixels, image_settings, block_size = o.dtype, o.max_pixels, o.image_settings, o.block_size
    quantization, kv_cache_dtype, video_seconds = o.quantization, o.kv_cache_dtype, o.video_seconds
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    b = DTYPE_BYTES[dtype]
    text = text_config(hf_config)
    vis = vision_params(hf_config) * b
    source = f"max_pixels={max_pixels:,}" if max_pixels is not None else ""
    if vis and max_pixels is None:
        from atlas_vlm.models.processor_settings import image_processor_settings

        image_settings = image_settings or image_processor_settings(None, hf_config)
        max_pixels, source = image_settings.max_pixels, image_settings.source
    max_pixels = max_pixels if vis else 0
    weights = text_weight_bytes(hf_config, quantization, b) + vis
    peak = vision_activation_peak(hf_config, max_pixels, b)
    spec = kv_cache_spec(num_full_attention_layers(text), num_kv_heads(text), head_dim(text), TORCH_DTYPES[b],
                         kv_cache_dtype)
    budget = kv_cache_budget(o.gpu_memory, o.gpu_memory_utilization, weights + RUNTIME_OVERHEAD_BYTES,
                             ACTIVATION_RESERVE_BYTES + peak)
    state = state_spec_from_config(text)
    slots = o.max_num_seqs if state is not None else 0
    state_per_seq = state.bytes_per_seq if state is not None else 0
    snaps = o.max_state_snapshots if state is not None else 0
    off = (slots + snaps) * state_per_seq
    blocks = num_kv_blocks(budget - off, spec, block_size) if budget >= off else 0
    length = o.max_model_len or min(text.max_position_embeddings, 4096)
    image_tokens = visual_tokens_per_image(hf_config, max_pixels) if vis else 0
    seqs = blocks // -(-length // block_size) if length >= image_tokens else 0
    seqs = min(seqs, slots) if state is not None else seqs
    frames, frame_pixels, video_tokens = video_tokens_per_clip(
        hf_config, video_seconds, o.video_sampling, fps=o.video_fps, max_frames=o.video_max_frames,
        nframes=o.video_frames) if vis else (0, 0, 0)
    usable = min(largest_image_pixels(hf_config, int(length * IMAGE_SHARE_OF_L)), max_pixels) if vis else 0
    return MemoryPlan(o.model, b, weights, vis, peak, spec.bytes_per_token, spec.bytes_per_token * block_size,
                      block_size, o.gpu_memory, o.gpu_memory_utilization, budget, blocks, length, max_pixels,
                      image_tokens, seqs, source, video_seconds, frames, frame_pixels, video_tokens, quantization,
                      usable, kv_cache_dtype=kv_cache_dtype, state_bytes_per_seq=state_per_seq, state_slots=slots,
                      state_snapshots=snaps)
