"""``EngineConfig``: every knob of the engine in one dataclass, validated on creation."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from atlas_vlm import hardware
from mm_token_pipeline import DEFAULT_HTTP_MAX_BYTES, DEFAULT_HTTP_TIMEOUT_S, MultiModalOptions

KV_CACHE_KINDS = ("paged", "contiguous")
SPECULATIVE_METHODS = (None, "ngram", "mtp")  # atlas_vlm.spec_decode's proposers
DEFAULT_KV_CACHE_DIR_MAX_BYTES = 10 << 30  # 10 GiB
ATTENTION_BACKENDS = ("auto", "reference", "bucketed", "decode_kernel")  # atlas_vlm.layers.attention's + "auto"


def kv_cache_dir_kwargs(path: str | None, max_gb: float | None) -> dict:
    """``EngineConfig`` fields of the CLIs' ``--kv-cache-dir PATH --kv-cache-dir-max-gb X``
    (X in GiB, 2**30 bytes; None: the default cap). Empty when ``path`` is None.

    Raises:
        ValueError: ``max_gb`` <= 0 or given without ``path`` (the message names the flag).
    """
    if path is None:
        if max_gb is not None:
            raise ValueError("--kv-cache-dir-max-gb needs --kv-cache-dir PATH")
        return {}
    if max_gb is None:
        return {"kv_cache_dir": path}
    if not max_gb > 0:
        raise ValueError(f"--kv-cache-dir-max-gb must be > 0 (GiB), got {max_gb}")
    return {"kv_cache_dir": path, "kv_cache_dir_max_bytes": max(1, int(max_gb * (1 << 30)))}


@dataclass
class EngineConfig:
    """Engine settings (names follow vLLM).

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    model: str  # HF model folder, .gguf file or Hugging Face Hub id ORG/NAME
    # llama.cpp's mmproj GGUF (the vision tower) of the VLM whose language model GGUF `model` is
    # (atlas_vlm.quantization.gguf_mmproj); None: no mmproj
    mmproj: str | None = None
    revision: str | None = None  # Hub branch / tag / commit when model is a Hub id (None: main)
    kv_cache: str = "paged"  # "paged" (blocks) or "contiguous" (one max_model_len strip per request)
    # K/V storage: "auto" (the model dtype), "int8" or "fp8_e4m3" (8-bit codes with one scale per
    # token and KV head: mm_kv_cache_management.kv_quant)
    kv_cache_dtype: str = "auto"
    kvcache_block_size: int = 16  # tokens per KV block
    num_kvcache_blocks: int = -1  # -1: derive from memory (below)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    kv_cache_memory: int = 1 << 30  # CPU: bytes reserved for K/V when num_kvcache_blocks == -1
    max_model_len: int | None = None  # tokens per request (prompt + output); None: min(model max, 4096)
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True  # split long prompts across steps
    enable_prefix_caching: bool = True  # share computed full blocks by content hash
    # hybrid models (Qwen3.5) under prefix caching: the linear-attention state is snapshotted every
    # hybrid_snapshot_interval tokens (a multiple of kvcache_block_size) into a pool of
    # max_state_snapshots (StateSpec.bytes_per_seq each, ~20 MB for Qwen3.5-0.8B, off the KV
    # budget); a hit resumes from the last snapshot. 0 snapshots: prefix caching off for them
    hybrid_snapshot_interval: int = 256
    max_state_snapshots: int = 16
    dtype: str = "auto"  # "auto": bf16 on CUDA (fp16 without bf16) and on a CPU with AMX/AVX512-BF16, else fp32
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    # "auto" (default): "decode_kernel" on CPU where the C decode kernel builds, else "bucketed";
    # "decode_kernel" (bucketed prefill + kernels/csrc/paged_decode.c for decode rows, from the blocks),
    # "bucketed" (layers/attention_bucketed: SDPA per context-length bucket), or "reference"
    # (padded SDPA with a dense mask, the exactness reference for the other two)
    attention_backend: str = "auto"
    # per-image area bounds after smart_resize (pixels); None: the checkpoint's own
    # (preprocessor_config.json, mm_token_pipeline.image_processor_settings)
    min_pixels: int | None = None
    max_pixels: int | None = None
    limit_request_pixels: bool = False  # requests may lower max_pixels, never raise it (the server sets this)
    allow_http_images: bool = False  # fetch http(s) image URLs
    http_image_timeout_s: float = DEFAULT_HTTP_TIMEOUT_S  # overall deadline of one image download (s)
    http_image_max_bytes: int = DEFAULT_HTTP_MAX_BYTES  # byte cap of one image download
    # media encoder (vLLM v1's encoder cache and encoder_compute_budget), in encoder rows =
    # placeholder tokens: outputs kept by content hash (LRU), and rows encoded per step (None:
    # max_num_batched_tokens); one item larger than the budget still runs, alone in its step
    encoder_cache_tokens: int = 16384
    max_num_encoder_tokens: int | None = None
    seed: int = 0  # default sampling seed of requests that set none
    # CPU threads for torch; None: $OMP_NUM_THREADS if set, else the usable cores less those
    # busy with other work, chosen once per process (hardware.default_num_threads)
    num_threads: int | None = None
    # weight-only quantization (atlas_vlm.quantization): None (dense), "int8" / "int4" (quantized
    # at load, round to nearest), "gguf" (a .gguf's tensors as stored), "awq" / "gptq" (read from
    # the checkpoint's quantization_config, which is honoured when this is None)
    quantization: str | None = None
    reasoning_parser: str | None = None  # "qwen3": <think>..</think> reasoning; grammars apply after it
    # tool-call format (atlas_vlm.tool_parsers: hermes, qwen3_coder, llama3_json, mistral);
    # None: detected from the chat template's text
    tool_call_parser: str | None = None
    # pure-decode steps through a torch.compile'd forward, one graph per batch-size bucket
    # (worker/compiled_decode.py): True, False, or "auto" (on where it pays and inductor works:
    # CUDA; off on CPU, where it was measured not to pay). The eager path is the fallback.
    compile_decode: bool | str = "auto"
    # exact speculative decoding (atlas_vlm.spec_decode, docs/speculative.md): "ngram" (prompt-lookup
    # drafts, vLLM's method="ngram"), "mtp" (a Qwen3.5 checkpoint's MTP head) or None (off); drafts
    # per decode step (None: 4 when on), and the longest / shortest n-gram looked up (vLLM's
    # prompt_lookup_max / prompt_lookup_min)
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # no drafts while more than this many requests run (vLLM's speculative_disable_by_batch_size;
    # None: draft at any batch size). Measured (scripts/bench.py --spec, SmolLM2, CPU): one stream
    # 2.2-4.3x on copying tasks, but 4, 8 and 16 requests ran at 0.8-0.92x with drafts: a batched
    # step is no longer bound by reading the weights once, so verification rows cost compute
    speculative_disable_by_batch_size: int | None = 2
    # disk tier below the prefix cache (mm_kv_cache_management/disk_tier.py): full KV blocks are
    # written to kv_cache_dir/<fingerprint>/ and found again, also after a restart; None: off.
    # Needs prefix caching (and the paged cache). Size cap in bytes, least recently used out first.
    kv_cache_dir: str | None = None
    kv_cache_dir_max_bytes: int = DEFAULT_KV_CACHE_DIR_MAX_BYTES
    # batch-invariant mode (docs/deterministic.md): a request's logits (so its greedy tokens and
    # logprobs) do not depend on what else runs in its step, on chunked prefill or on the step's
    # row count; CPU, dense weights, C decode kernel only (else ValueError at load); slower
    deterministic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not (isinstance(self.compile_decode, bool) or self.compile_decode == "auto"):
            raise ValueError(f"compile_decode must be True, False or 'auto', got {self.compile_decode!r}")
        if self.tool_call_parser is not None:
            from atlas_vlm.tool_parsers import ToolParserManager

            ToolParserManager.get_tool_parser(self.tool_call_parser)  # ValueError listing the known names
        from mm_kv_cache_management.kv_quant import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)  # ValueError naming the known formats
        self._check_speculative()
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}")
        for name in ("kvcache_block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hybrid_snapshot_interval < 1:  # a multiple of the block size: checked with a hybrid model
            raise ValueError(f"hybrid_snapshot_interval must be >= 1 (tokens), got {self.hybrid_snapshot_interval}")
        if self.max_state_snapshots < 0:
            raise ValueError(f"max_state_snapshots must be >= 0 (0: no prefix caching for hybrid models), "
                             f"got {self.max_state_snapshots}")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                                             or self.num_threads < 1):
            raise ValueError(f"num_threads must be an int >= 1 or None (auto), got {self.num_threads!r}")
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks must be -1 (auto) or >= 1, got {self.num_kvcache_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not (isinstance(self.http_image_timeout_s, (int, float)) and self.http_image_timeout_s > 0):
            raise ValueError(f"http_image_timeout_s must be > 0 seconds, got {self.http_image_timeout_s!r}")
        if isinstance(self.http_image_max_bytes, bool) or not isinstance(self.http_image_max_bytes, int) \
                or self.http_image_max_bytes < 1:
            raise ValueError(f"http_image_max_bytes must be an int >= 1, got {self.http_image_max_bytes!r}")
        if isinstance(self.encoder_cache_tokens, bool) or not isinstance(self.encoder_cache_tokens, int) \
                or self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must be an int >= 0 (tokens), got {self.encoder_cache_tokens!r}")
        if self.max_num_encoder_tokens is not None and (isinstance(self.max_num_encoder_tokens, bool) or not
                                                         isinstance(self.max_num_encoder_tokens, int)
                                                         or self.max_num_encoder_tokens < 1):
            raise ValueError(f"max_num_encoder_tokens must be an int >= 1 (tokens) or None, "
                             f"got {self.max_num_encoder_tokens!r}")
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 (pixels) or None (the checkpoint's), got {value!r}")
        self._check_kv_cache_dir()
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        from atlas_vlm.quantization import check_quantization

        check_quantization(self.quantization)  # ValueError naming the known methods, before any load
        if self.mmproj is not None and not str(self.model).endswith(".gguf"):
            raise ValueError(f"mmproj={self.mmproj!r} needs model to be its language model's .gguf file, "
                             f"got model={self.model!r}")

    def _check_speculative(self) -> None:
        """Raises ValueError naming the speculative-decoding field that is out of range."""
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"num_speculative_tokens must be an int >= 1 (tokens) or None, got {k!r}")
        if k is not None and self.speculative is None:
            raise ValueError("num_speculative_tokens is set but speculative is None (off); "
                             "pass speculative='ngram' or 'mtp' (--speculative ngram|mtp) to turn speculation on")
        b = self.speculative_disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_disable_by_batch_size must be an int >= 1 (requests) or None, got {b!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if isinstance(lo, bool) or not isinstance(lo, int) or lo < 1:
            raise ValueError(f"prompt_lookup_min must be an int >= 1 (tokens), got {lo!r}")
        if isinstance(hi, bool) or not isinstance(hi, int) or hi < lo:
            raise ValueError(f"prompt_lookup_max must be an int >= prompt_lookup_min ({lo}), got {hi!r}")

    @property
    def speculative_tokens(self) -> int:
        """Drafts per decode step: 0 with speculation off, else ``num_speculative_tokens`` (4 if None)."""
        if self.speculative is None:
            return 0
        return 4 if self.num_speculative_tokens is None else self.num_speculative_tokens

    def _check_kv_cache_dir(self) -> None:
        if isinstance(self.kv_cache_dir_max_bytes, bool) or not isinstance(self.kv_cache_dir_max_bytes, int) \
                or self.kv_cache_dir_max_bytes < 1:
            raise ValueError(f"kv_cache_dir_max_bytes must be an int >= 1 (bytes), got {self.kv_cache_dir_max_bytes!r}")
        if self.kv_cache_dir is None:
            return
        if not isinstance(self.kv_cache_dir, (str, os.PathLike)) or not str(self.kv_cache_dir):
            raise ValueError(f"kv_cache_dir must be a folder path or None, got {self.kv_cache_dir!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir (the disk KV tier) needs prefix caching on: drop "
                             "enable_prefix_caching=False / --no-enable-prefix-caching, or unset kv_cache_dir")
        if self.kv_cache != "paged":
            raise ValueError(f"kv_cache_dir (the disk KV tier) needs kv_cache='paged', got {self.kv_cache!r}")
        self.kv_cache_dir = os.fspath(self.kv_cache_dir)

    def image_bounds(self, settings) -> MultiModalOptions:
        """The engine's image bounds: the checkpoint's ``settings``
        (``mm_token_pipeline.ImageProcessorSettings``) with this config's ``min_pixels`` /
        ``max_pixels`` over them. SmolVLM bounds by its processor's longest edge: only this
        config's own values are returned there.

        Raises:
            ValueError: the resolved ``min_pixels > max_pixels``; the message says where each
                came from (this config, i.e. ``--min-pixels`` / ``--max-pixels``, or the checkpoint).
        """
        if settings is None or settings.longest_edge is not None:
            return MultiModalOptions(min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        lo = settings.min_pixels if self.min_pixels is None else self.min_pixels
        hi = settings.max_pixels if self.max_pixels is None else self.max_pixels
        if lo > hi:
            def origin(mine, flag):
                return f"set by {flag}" if mine is not None else f"from {settings.source}"
            raise ValueError(f"max_pixels {hi} ({origin(self.max_pixels, 'max_pixels / --max-pixels')}) is below "
                             f"min_pixels {lo} ({origin(self.min_pixels, 'min_pixels / --min-pixels')}); "
                             "set both so that min_pixels <= max_pixels")
        return MultiModalOptions(min_pixels=lo, max_pixels=hi)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The compute / weight / KV dtype.

        ``"auto"``: on CUDA bf16 (fp16 where the GPU lacks bf16); on CPU bf16 where it has
        native bf16 dot products (``hardware.cpu_features().fast_bf16``: AMX-BF16 or
        AVX512-BF16), else fp32 (emulated bf16 is slower than fp32). fp32 is the exactness reference: parity tests
        pass ``dtype="float32"``.

        Raises:
            ValueError: ``dtype`` is not "auto", "float32", "bfloat16" or "float16".
        """
        if self.dtype == "auto":
            if self.torch_device().type != "cuda":
                return torch.bfloat16 if hardware.cpu_features().fast_bf16 else torch.float32
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(dtypes)}, got {self.dtype!r}")
        return dtypes[self.dtype]
