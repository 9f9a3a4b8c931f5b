"""``EngineConfig``: every knob of the engine in one dataclass, validated on creation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mm_token_pipeline import DEFAULT_HTTP_MAX_BYTES, DEFAULT_HTTP_TIMEOUT_S, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

KV_CACHE_KINDS = ("paged", "contiguous")
ATTENTION_BACKENDS = ("auto", "reference", "bucketed", "decode_kernel")  # atlas_vlm.layers.attention's + "auto"
CPU_BF16_FEATURES = ("amx_bf16", "avx512_bf16")  # x86 flags with native bf16 dot products


def cpu_has_fast_bf16(capabilities: Mapping[str, object] | None = None) -> bool:
    """Whether this CPU computes bf16 matmuls natively (AMX-BF16 or AVX512-BF16).

    Detected, not assumed: ``capabilities`` defaults to ``torch.cpu.get_capabilities()``
    (torch >= 2.8; cpuinfo-based, keys as Linux ``/proc/cpuinfo`` flags, e.g. ``amx_bf16``,
    ``avx512_bf16``). On an older torch without it, the ``flags`` line of ``/proc/cpuinfo``
    is read; where neither exists (not Linux/x86), the answer is False. Without these
    instructions oneDNN emulates bf16 through fp32 and is slower than fp32, so fp32 stays.
    """
    if capabilities is None:
        capabilities = _detected_cpu_capabilities()
    return any(bool(capabilities.get(flag, False)) for flag in CPU_BF16_FEATURES)


def cpuinfo_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The ``flags`` line of Linux's ``cpuinfo`` (e.g. ``avx2``, ``avx512f``); empty where the
    file is missing or has none (not Linux / not x86)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def _detected_cpu_capabilities(cpuinfo: str = "/proc/cpuinfo") -> Mapping[str, object]:
    """``torch.cpu.get_capabilities()``, else ``{flag: True}`` for the flags in ``cpuinfo``."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return get()
    return {flag: True for flag in cpuinfo_flags(cpuinfo)}


@dataclass
class EngineConfig:
    """Engine settings (names follow vLLM).

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    model: str  # HF model folder, .gguf file or Hugging Face Hub id ORG/NAME
    revision: str | None = None  # Hub branch / tag / commit when model is a Hub id (None: main)
    kv_cache: str = "paged"  # "paged" (blocks) or "contiguous" (one max_model_len strip per request)
    kvcache_block_size: int = 16  # tokens per KV block
    num_kvcache_blocks: int = -1  # -1: derive from memory (below)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    kv_cache_memory: int = 1 << 30  # CPU: bytes reserved for K/V when num_kvcache_blocks == -1
    max_model_len: int | None = None  # tokens per request (prompt + output); None: min(model max, 4096)
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True  # split long prompts across steps
    enable_prefix_caching: bool = True  # share computed full blocks by content hash
    dtype: str = "auto"  # "auto": bf16 on CUDA (fp16 without bf16) and on a CPU with AMX/AVX512-BF16, else fp32
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    # "auto" (default): "decode_kernel" on CPU where the C decode kernel builds, else "bucketed";
    # "decode_kernel" (bucketed prefill + layers/csrc/paged_decode.c for decode rows, from the blocks),
    # "bucketed" (layers/attention_bucketed: SDPA per context-length bucket), or "reference"
    # (padded SDPA with a dense mask, the exactness reference for the other two)
    attention_backend: str = "auto"
    min_pixels: int = DEFAULT_MIN_PIXELS  # per-image lower bound after smart_resize (pixels)
    max_pixels: int = DEFAULT_MAX_PIXELS  # per-image upper bound after smart_resize (pixels)
    allow_http_images: bool = False  # fetch http(s) image URLs
    http_image_timeout_s: float = DEFAULT_HTTP_TIMEOUT_S  # overall deadline of one image download (s)
    http_image_max_bytes: int = DEFAULT_HTTP_MAX_BYTES  # byte cap of one image download
    seed: int = 0  # default sampling seed of requests that set none
    reasoning_parser: str | None = None  # "qwen3": <think>..</think> reasoning; grammars apply after it

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}")
        for name in ("kvcache_block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The compute / weight / KV dtype.

        ``"auto"``: on CUDA bf16 (fp16 where the GPU lacks bf16); on CPU bf16 where
        ``cpu_has_fast_bf16()``, else fp32. fp32 is the exactness reference: parity tests
        pass ``dtype="float32"``.

        Raises:
            ValueError: ``dtype`` is not "auto", "float32", "bfloat16" or "float16".
        """
        if self.dtype == "auto":
            if self.torch_device().type != "cuda":
                return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(dtypes)}, got {self.dtype!r}")
        return dtypes[self.dtype]
