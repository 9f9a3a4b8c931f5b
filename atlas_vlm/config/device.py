"""``DeviceConfig``: where and how the forward runs (vLLM's ``DeviceConfig``, with the
attention backend, the compiled decode step, batch invariance and the CPU threads).

Scope: validated on creation; the messages name the flat ``EngineConfig(...)`` keyword.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atlas_vlm.config.cli import flag

ATTENTION_BACKENDS = ("auto", "reference", "bucketed", "decode_kernel", "triton")  # the one list (layers.attention derives its own)


def _auto_bool(text: str) -> bool | str:
    """``--compile-decode`` value: "auto", or true / false (also 1 / 0, yes / no, on / off).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse's own error names the flag).
    """
    import argparse

    word = str(text).strip().lower()
    if word == "auto":
        return "auto"
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")


@dataclass
class DeviceConfig:
    """The device and the forward's execution choices.

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    device: str = "auto"
    """"auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"."""
    num_threads: int | None = None
    """CPU threads for torch; None: $OMP_NUM_THREADS if set, else the cores this process may run on
    (affinity, cgroup quota), as llama.cpp (hardware.default_num_threads)."""
    attention_backend: str = field(default="auto", metadata=flag(choices=ATTENTION_BACKENDS))
    """"auto": "triton" on CUDA where Triton imports (kernels/triton_attention.py), else
    "decode_kernel" on CPU where the C decode kernel builds, else "bucketed". "triton" forced also
    runs CPU tensors under TRITON_INTERPRET=1 (how CI tests it); "decode_kernel": bucketed prefill +
    kernels/csrc/paged_decode.c for decode rows, from the blocks; "bucketed": SDPA per context-length
    bucket (layers/attention_bucketed); "reference": padded SDPA with a dense mask, the exactness
    reference for the others."""
    compile_decode: bool | str = field(default="auto", metadata=flag(type=lambda text: _auto_bool(text),
                                                                      metavar="{auto,true,false}"))
    """Pure-decode steps through a torch.compile'd forward, one graph per batch-size bucket
    (worker/compiled_decode.py): true, false, or "auto" (on where it pays and inductor works: CUDA;
    off on CPU, where it was measured not to pay). The eager path is the fallback."""
    deterministic: bool = False
    """Batch-invariant mode (docs/deterministic.md): a request's logits (so its greedy tokens and
    logprobs) do not depend on what else runs in its step, on chunked prefill or on the step's row
    count; CPU, dense weights, C decode kernel only (else ValueError at load); slower."""

    def __post_init__(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not (isinstance(self.compile_decode, bool) or self.compile_decode == "auto"):
            raise ValueError(f"compile_decode must be True, False or 'auto', got {self.compile_decode!r}")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                                             or self.num_threads < 1):
            raise ValueError(f"num_threads must be an int >= 1 or None (auto), got {self.num_threads!r}")

    def torch_device(self) -> torch.device:
        """``device`` as a ``torch.device`` ("auto": CUDA when available, else CPU)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
