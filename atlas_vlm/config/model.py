"""``ModelConfig``: which model is loaded and how (vLLM's ``ModelConfig``).

Scope: the checkpoint (``model``, ``mmproj``, ``revision``, ``hf_file``), its dtype, length and weight
quantization, the default sampling seed and the output parsers. Validated on creation; the
messages name the flat ``EngineConfig(...)`` / ``LLM(...)`` keyword.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atlas_vlm import hardware
from atlas_vlm.config.cli import flag

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _quantization_methods() -> tuple:
    from atlas_vlm.quantization import QUANTIZATION_METHODS

    return QUANTIZATION_METHODS


def _reasoning_parsers() -> list[str]:
    from atlas_vlm.reasoning import ReasoningParserManager

    return ReasoningParserManager.names()


def _tool_parsers() -> list[str]:
    from atlas_vlm.tool_parsers import ToolParserManager

    return ToolParserManager.names()


@dataclass
class ModelConfig:
    """The model and how it is loaded.

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    model: str = field(metadata=flag(skip="each command takes it its own way: serve's positional MODEL (and the "
                                           "router's --model [NAME=]PATH), generate's --model, chat's positional MODEL"))
    """HF model folder, .gguf file or Hugging Face Hub id ORG/NAME."""
    mmproj: str | None = None
    """llama.cpp's mmproj GGUF (the vision tower) of the VLM whose language model GGUF is the model
    (atlas_vlm.quantization.gguf_mmproj); None: no mmproj."""
    revision: str | None = None
    """Hub branch / tag / commit when the model is a Hub id (None: main)."""
    hf_file: str | None = field(default=None, metadata=flag(metavar="NAME.gguf"))
    """The .gguf of a Hub GGUF repo model to load (llama.cpp's --hf-file); None: by the id's :QUANT tag
    (ORG/NAME-GGUF:Q8_0), else Q4_K_M, else the repo's first .gguf (atlas_vlm.hub_gguf)."""
    dtype: str = field(default="auto", metadata=flag(choices=("auto", *DTYPES)))
    """Weights, activations and K/V: "auto" is bf16 on CUDA (fp16 without bf16) and on a CPU with
    AMX/AVX512-BF16, else fp32 (the exactness reference)."""
    max_model_len: int | None = None
    """Tokens per request (prompt + output); None: min(the model's max, 4096)."""
    quantization: str | None = field(default=None, metadata=flag(choices=lambda: _quantization_methods()))
    """Weight-only quantization (atlas_vlm.quantization): None (as stored: dense weights, a .gguf's
    own blocks memory-mapped), "int8" / "int4" (quantized at load, round to nearest), "gguf" (= None
    for a .gguf), "gguf_int" (a .gguf converted to our int8 / int4 tiles), "dequantize" (a .gguf's
    dense copy), "awq" / "gptq" (read from the checkpoint's quantization_config, which is honoured
    when this is None)."""
    seed: int = 0
    """Default sampling seed of requests that set none."""
    reasoning_parser: str | None = field(default=None, metadata=flag(choices=lambda: _reasoning_parsers()))
    """Split <think>..</think> reasoning into reasoning_content (atlas_vlm.reasoning registry:
    "qwen3": Qwen3 / Qwen3-VL; "deepseek_r1"); grammars apply after it. None: no split."""
    tool_call_parser: str | None = field(default=None, metadata=flag(choices=lambda: _tool_parsers()))
    """Tool-call format (atlas_vlm.tool_parsers): hermes (<tool_call> JSON), qwen3_coder (XML),
    llama3_json, mistral; None: detected from the chat template's text."""

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            from atlas_vlm.reasoning import ReasoningParserManager

            ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)  # ValueError listing the known names
        if self.tool_call_parser is not None:
            from atlas_vlm.tool_parsers import ToolParserManager

            ToolParserManager.get_tool_parser(self.tool_call_parser)  # ValueError listing the known names
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        from atlas_vlm.quantization import check_quantization

        check_quantization(self.quantization)  # ValueError naming the known methods, before any load
        from atlas_vlm.hub import is_gguf_repo_form, looks_like_repo_id

        hub_gguf = looks_like_repo_id(str(self.model)) and is_gguf_repo_form(str(self.model), self.hf_file)
        if self.hf_file is not None and not looks_like_repo_id(str(self.model)):
            raise ValueError(f"hf_file={self.hf_file!r} needs model to be a Hub GGUF repo ORG/NAME, got model={self.model!r}")
        if self.mmproj is not None and not str(self.model).endswith(".gguf") and not hub_gguf:
            raise ValueError(f"mmproj={self.mmproj!r} needs model to be its language model's .gguf file, "
                             f"got model={self.model!r}")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The compute / weight / KV dtype on ``device``.

        ``"auto"``: on CUDA bf16 (fp16 where the GPU lacks bf16); on CPU bf16 where it has
        native bf16 dot products (``hardware.cpu_features().fast_bf16``: AMX-BF16 or
        AVX512-BF16), else fp32 (emulated bf16 is slower than fp32). fp32 is the exactness
        reference: parity tests pass ``dtype="float32"``.

        Raises:
            ValueError: ``dtype`` is not "auto", "float32", "bfloat16" or "float16".
        """
        if self.dtype == "auto":
            if device.type != "cuda":
                return torch.bfloat16 if hardware.cpu_features().fast_bf16 else torch.float32
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]
