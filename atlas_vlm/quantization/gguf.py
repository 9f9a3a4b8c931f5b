"""GGUF tensors and our modules: the name tables and helpers the as-stored loader
(``gguf_stored``: the default for a ``.gguf``) uses, and the exact conversion of each block
format to our ``Int4Linear`` / ``Int8Linear`` that ``.gguf`` loads used before it (the decoders
and the per-type table: ``gguf_types``; kept for the tests and benchmarks that compare formats).

Types a ``.gguf`` may hold (``SUPPORTED_TYPES``, checked by :func:`check_types` before any
work): F32 / F16 / BF16, Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL,
IQ4_XS; any other (IQ2_*, IQ3_*, TQ*, ...) is refused naming the tensor, its type and the list.
Conversion (:func:`_module_for`): a fused projection takes ``Int4Linear`` when every part is an
int4 type, else an ``Int8Linear`` with the finest group of its parts and mins when a part has them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from atlas_vlm.layers.gguf_linear import drop_mapped_pages
from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear
from atlas_vlm.quantization import UnsupportedQuantizationError
from atlas_vlm.quantization.gguf_types import DECODERS, HAS_MIN, INT4_TYPES, INT8_TYPES, group_of, int8_form

DENSE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = DENSE_TYPES + INT8_TYPES + INT4_TYPES

_PROJ = {  # GGUF name part -> (our module path under model.layers.i, shard or None)
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1), "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", None), "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1), "ffn_down": ("mlp.down_proj", None),
}
_PARAM = {  # GGUF name part -> our parameter under model.layers.i
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def dense_tensor(t) -> torch.Tensor:
    """A dense GGUF tensor (F32 / F16 / BF16) as fp32, in HF's shape (GGUF lists dims reversed)."""
    kind = t.tensor_type.name
    arr = np.asarray(t.data)
    if kind == "BF16":
        out = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16).astype(np.int32) << 16).view(torch.float32)
    else:
        out = torch.from_numpy(np.array(arr, dtype=np.float32))
    return out.reshape(tuple(int(x) for x in reversed(t.shape)))


def _rows_of(t) -> np.ndarray:
    """A quantized GGUF tensor's rows ``[N, bytes_per_row]`` (uint8)."""
    n = int(t.shape[-1]) if len(t.shape) > 1 else 1
    return np.asarray(t.data).reshape(n, -1)


# ---- loading ------------------------------------------------------------------------------------

def _row_permutation(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's Q/K permutation (transformers' ``_reverse_permute_weights``)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def check_types(tensors) -> None:
    """Refuse, before any decoding, the first GGUF tensor whose type we do not run.

    Raises:
        UnsupportedQuantizationError: names the tensor, its type and ``SUPPORTED_TYPES``.
    """
    for t in tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedQuantizationError(f"GGUF tensor {t.name} has type {t.tensor_type.name}; supported: "
                                               f"{', '.join(SUPPORTED_TYPES)}")


def _module_for(parts: list, linear: nn.Linear) -> nn.Module:
    """The empty module holding GGUF tensors ``parts`` (one projection's shards), see the
    module docstring. Raises UnsupportedQuantizationError for a type we do not run or a mix of
    dense and quantized parts."""
    check_types(parts)
    kinds = {t.tensor_type.name for t in parts}
    args = (linear.in_features, linear.out_features, linear.bias is not None)
    if kinds <= set(DENSE_TYPES):
        return nn.Linear(*args)
    if kinds <= set(INT4_TYPES):
        return Int4Linear(*args, group_size=32)
    if kinds & set(DENSE_TYPES):
        raise UnsupportedQuantizationError(f"GGUF tensors {[t.name for t in parts]} of one fused projection mix "
                                           f"types {sorted(kinds)}; Atlas VLM needs all dense or all quantized")
    return Int8Linear(*args, group_size=min(group_of(k) for k in kinds), has_min=bool(kinds & set(HAS_MIN)))


def copy_dense_params(params: dict, tensors: dict, num_layers: int, file_name: str, used: set) -> None:
    """Copy every per-layer dense parameter (``_PARAM``: norms, biases) and the final norm from
    the GGUF ``tensors`` (name -> reader tensor) into ``params`` (``model.named_parameters()``),
    adding the tensor names to ``used``.

    Raises:
        ValueError: a parameter the model has whose tensor the file lacks (named, with the file).
    """
    for i in range(num_layers):
        for part, ours in _PARAM.items():
            name, target = f"blk.{i}.{part}", f"model.layers.{i}.{ours}"
            if target in params:
                if name not in tensors:
                    raise ValueError(f"GGUF {file_name} lacks {name}")
                params[target].data.copy_(dense_tensor(tensors[name]))
                used.add(name)
    params["model.norm.weight"].data.copy_(dense_tensor(tensors["output_norm.weight"]))
    used.add("output_norm.weight")


def drop_pages(reader, t) -> None:
    """Drop the resident pages of tensor ``t``'s bytes from ``reader``'s memory map once the
    tensor is converted or interleaved, so a load's peak RSS does not hold the file beside what
    was made from it (``layers.gguf_linear.drop_mapped_pages``: ``MADV_DONTNEED`` on a read-only
    file mapping, a later read faults them back in). A no-op where ``t`` is not in a file map."""
    drop_mapped_pages(t.data)


def _load_rows(module: nn.Module, row: int, t, perm: torch.Tensor | None) -> int:
    kind = t.tensor_type.name
    if kind in DENSE_TYPES:
        w = dense_tensor(t)
        if perm is not None:
            w = w[perm]
        module.weight.data[row:row + w.shape[0]].copy_(w)
        return w.shape[0]
    if isinstance(module, Int8Linear):  # scales, (mins): [N, groups] each
        q, *scales = int8_form(kind, _rows_of(t), module.group_size, module.has_min)
    else:
        q, *scales = DECODERS[kind](_rows_of(t))
    if perm is not None:
        q, scales = q[perm], [s[perm] for s in scales]
    module.load_rows(row, q, *scales)
    return q.shape[0]
