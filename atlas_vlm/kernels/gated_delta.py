"""A small C kernel for a Gated DeltaNet layer's decode step (``csrc/gated_delta.c``): one new
token per sequence, over a batch, straight on the layer's ``StateCache`` slots.

In one call: the depthwise causal conv1d with the conv state shift (+ SiLU), q/k L2-norm,
the gated delta rule's recurrent update of each sequence's fp32 state in place in its slot,
and the output. Rules: HF transformers 5.25 ``modeling_qwen3_5.py`` (``causal_conv1d_update``,
``torch_recurrent_gated_delta_rule``). ``decode_step_reference`` is the same step in PyTorch
(HF's own recurrent rule), with the same arguments and answer: ``decode_step`` uses it where
the kernel cannot run. Measured (``benchmarks/gated_delta.py``, one thread, a random Qwen3.5
with hidden 512 and 6 Gated DeltaNet layers of 8 layers): PyTorch's conv + state gather /
write-back + rule took 19-59% of a decode step (batch 1 / 16, fp32 / bf16); the kernel does
that work 5-13x faster, the whole decode step 1.2-1.3x (batch 1), 1.6-2.3x (batch 16) faster.

Built on first use like the other kernels (``kernels/cbuild.py``: ``-O3 -fopenmp``, ``-march``
from ``hardware.cpu_features()``); without a compiler (or if the build fails) ``available()``
is False, the reason is logged once, and the layer keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from atlas_vlm.kernels import cbuild

SOURCE = Path(__file__).with_name("csrc") / "gated_delta.c"
MAX_HEAD_DIM, MAX_CONV_KERNEL = 256, 16  # as the C source


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (once per source + flags) and load the kernel; None (logged) when impossible."""
    lib = cbuild.load(SOURCE, cbuild.cpu_flags(), [([], ["-lm"])], "Gated DeltaNet decode uses PyTorch")
    if lib is None:
        return None
    fn = lib.gated_delta_decode
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 7 + \
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _library() is not None


def unsupported_reason(device: torch.device | str, dtype: torch.dtype, num_k_heads: int, num_v_heads: int,
                       head_k_dim: int, head_v_dim: int, conv_kernel: int) -> str | None:
    """Why the kernel cannot serve a layer with these sizes on ``device``; None when it can
    (builds the kernel on the first call)."""
    if torch.device(device).type != "cpu":
        return f"it runs on CPU only, not {torch.device(device).type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 or bfloat16, not {dtype}"
    if max(head_k_dim, head_v_dim) > MAX_HEAD_DIM or not 2 <= conv_kernel <= MAX_CONV_KERNEL or num_v_heads % num_k_heads:
        return (f"it takes head dims <= {MAX_HEAD_DIM}, a conv kernel of 2..{MAX_CONV_KERNEL} and num_v_heads a "
                f"multiple of num_k_heads, got {head_k_dim}/{head_v_dim}, {conv_kernel}, {num_v_heads}/{num_k_heads}")
    if not available():
        return "it could not be built here (no C compiler, or the build failed: see the log)"
    return None


def _check(qkv, b, a, conv_weight, conv_state, recurrent_state, slots, has_initial_state, num_k_heads, head_k_dim,
           head_v_dim) -> tuple[int, int]:
    """(num_v_heads, conv kernel) after checking every shape; ValueError naming the input otherwise."""
    n, num_v_heads = qkv.shape[0], recurrent_state.shape[1] if recurrent_state.dim() == 4 else -1
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    kernel = conv_weight.shape[-1]
    want = {"qkv": (qkv, (n, conv_dim)), "b": (b, (n, num_v_heads)), "a": (a, (n, num_v_heads)),
            "conv_weight": (conv_weight.reshape(conv_weight.shape[0], -1), (conv_dim, kernel)),
            "conv_state": (conv_state, (conv_state.shape[0], conv_dim, kernel - 1)),
            "recurrent_state": (recurrent_state, (recurrent_state.shape[0], num_v_heads, head_k_dim, head_v_dim)),
            "slots": (slots, (n,)), "has_initial_state": (has_initial_state, (n,))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"gated delta decode: {name} has shape {tuple(t.shape)}, expected {shape}")
    if conv_state.shape[0] != recurrent_state.shape[0]:
        raise ValueError(f"gated delta decode: conv_state has {conv_state.shape[0]} slots, recurrent_state "
                         f"{recurrent_state.shape[0]}")
    ids = slots.tolist()
    if n and (min(ids) < 0 or max(ids) >= conv_state.shape[0] or len(set(ids)) != n):
        raise ValueError(f"gated delta decode: slots {ids} must be distinct slots in 0..{conv_state.shape[0] - 1}")
    return num_v_heads, kernel


def _states_fit(conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> bool:
    """The kernel writes the states through raw pointers: contiguous fp32 CPU tensors only."""
    return all(t.is_contiguous() and t.dtype == torch.float32 and t.device.type == "cpu"
               for t in (conv_state, recurrent_state))


def decode_step(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
                has_initial_state: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """One decode token per sequence through a Gated DeltaNet token mixer (conv1d + SiLU, gated
    delta rule with q/k L2-norm); the slots' states are read and written in place.

    Args:
        qkv: ``[n, conv_dim]`` (``in_proj_qkv`` output, channels q | k | v), float32 / bfloat16.
        b, a: ``[n, num_v_heads]`` (``in_proj_b`` / ``in_proj_a`` outputs), ``qkv``'s dtype.
        conv_weight: ``[conv_dim, 1, kernel]`` (``nn.Conv1d`` depthwise) or ``[conv_dim, kernel]``.
        A_log, dt_bias: ``[num_v_heads]``.
        conv_state: one layer's ``StateCache.conv``, ``[num_slots, conv_dim, kernel - 1]`` fp32.
        recurrent_state: one layer's ``StateCache.recurrent``, ``[num_slots, num_v_heads,
            head_k_dim, head_v_dim]`` fp32.
        slots: ``[n]`` distinct slot per sequence (any order); has_initial_state: ``[n]`` bool
            (False: the sequence starts from zero state, whatever its slot holds).

    Returns:
        ``[n, num_v_heads, head_v_dim]`` in ``qkv``'s dtype (before the gated norm).

    Raises:
        ValueError: a shape disagrees, slots repeat or fall outside the cache.
    """
    _check(qkv, b, a, conv_weight, conv_state, recurrent_state, slots, has_initial_state, num_k_heads, head_k_dim,
           head_v_dim)
    num_v_heads, kernel = recurrent_state.shape[1], conv_weight.shape[-1]
    lib = _library()
    if lib is None or unsupported_reason(qkv.device, qkv.dtype, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                                         kernel) or not _states_fit(conv_state, recurrent_state):
        return decode_step_reference(qkv, b, a, conv_weight, A_log, dt_bias, conv_state, recurrent_state, slots,
                                     has_initial_state, num_k_heads, head_k_dim, head_v_dim)
    n = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    b, a = b.to(qkv.dtype).contiguous(), a.to(qkv.dtype).contiguous()
    weight = conv_weight.detach().reshape(conv_weight.shape[0], kernel).float().contiguous()
    a_log, bias = A_log.detach().float().contiguous(), dt_bias.detach().float().contiguous()
    slot_ids = slots.to(torch.int64).contiguous()
    flags = has_initial_state.to(torch.uint8).contiguous()
    scratch = torch.empty(n, qkv.shape[1], dtype=torch.float32)
    out = torch.empty(n, num_v_heads, head_v_dim, dtype=qkv.dtype)
    status = lib.gated_delta_decode(qkv.data_ptr(), qkv.stride(0), a.data_ptr(), b.data_ptr(), weight.data_ptr(),
                                    a_log.data_ptr(), bias.data_ptr(), conv_state.data_ptr(),
                                    recurrent_state.data_ptr(), slot_ids.data_ptr(), flags.data_ptr(), n,
                                    conv_state.shape[0], num_k_heads, num_v_heads, head_k_dim, head_v_dim, kernel,
                                    scratch.data_ptr(), out.data_ptr(), int(qkv.dtype == torch.bfloat16),
                                    torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"gated delta decode kernel refused the sizes: heads {num_k_heads}/{num_v_heads}, dims "
                           f"{head_k_dim}/{head_v_dim}, conv kernel {kernel}")
    return out


def decode_step_reference(qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, conv_state: torch.Tensor,
                          recurrent_state: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
                          num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """``decode_step`` in PyTorch (HF's ``torch_recurrent_gated_delta_rule``): same arguments,
    same answer and the same in-place state update; the conv runs in ``conv_weight``'s dtype as
    the layer's own path does. Raises ValueError as ``decode_step``."""
    num_v_heads, kernel = _check(qkv, b, a, conv_weight, conv_state, recurrent_state, slots, has_initial_state,
                                 num_k_heads, head_k_dim, head_v_dim)
    n, conv_dim = qkv.shape
    weight = conv_weight.reshape(conv_dim, 1, kernel)
    slots = slots.to(device=conv_state.device, dtype=torch.int64)
    fresh = ~has_initial_state.to(device=conv_state.device, dtype=torch.bool)
    conv = conv_state[slots].masked_fill(fresh[:, None, None], 0.0)
    rec = recurrent_state[slots].masked_fill(fresh[:, None, None, None], 0.0)
    window = torch.cat([conv.to(weight.dtype), qkv[:, :, None].to(weight.dtype)], dim=-1)  # [n, conv_dim, kernel]
    mixed = F.silu(F.conv1d(window, weight, groups=conv_dim)).to(qkv.dtype)[:, :, 0]  # [n, conv_dim]
    key_dim = num_k_heads * head_k_dim
    query, key, value = mixed.split([key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    core, final = torch_recurrent_gated_delta_rule(
        query.reshape(n, 1, num_k_heads, head_k_dim), key.reshape(n, 1, num_k_heads, head_k_dim),
        value.reshape(n, 1, num_v_heads, head_v_dim), g=g[:, None], beta=b.sigmoid()[:, None], initial_state=rec,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    conv_state[slots] = window[..., 1:].to(conv_state.dtype)
    recurrent_state[slots] = final.to(recurrent_state.dtype)
    return core[:, 0]
