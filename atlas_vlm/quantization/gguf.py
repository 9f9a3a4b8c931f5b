"""GGUF tensors as stored (``quantization="gguf"``): read with the ``gguf`` package's
``GGUFReader`` (memory-mapped), each block format mapped exactly onto our modules, no dense
copy of a quantized tensor (the decoders and the per-type table: ``gguf_types``).

Supported: F32 / F16 / BF16 (dense), Q4_0 / Q4_1 / Q4_K (``Int4Linear``, group 32), Q8_0,
Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS (``Int8Linear``). A fused projection
(q/k/v, gate/up) takes one module for all its parts: ``Int4Linear`` when every part is an
int4 type, else an ``Int8Linear`` with the finest group of its parts (16 with a Q6_K / Q3_K /
Q2_K part, else 32) and mins when a part has them (Q4_K_M's Q4_K q/k next to a Q6_K v: int8,
group 16, mins), each part's ``W`` exact in it (the kernel runs groups of 16 too). Every tensor's type is
checked before any is decoded: any other type (IQ2_*, IQ3_*, TQ*, ...) is refused naming the
tensor, its type and the supported list; so is a projection mixing dense and quantized parts.
A quantized ``token_embd`` (any supported type) stays quantized as an ``Int8Linear`` in its
int8 form: lookups dequantize their rows (``QuantEmbedding``) and, tied (no ``output.weight``,
as SmolLM2's Q8_0), it is the LM head too; a Q4_K table holds 1.25 bytes a weight, not 4.
Config and tokenizer come from the GGUF header through ``transformers``, saved once as a small
folder without weights (``gguf_meta_folder``).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear, QuantEmbedding
from atlas_vlm.quantization import UnsupportedQuantizationError, build_empty, materialize
from atlas_vlm.quantization.gguf_types import DECODERS, HAS_MIN, INT4_TYPES, INT8_TYPES, group_of, int8_form

GGUF_META_VERSION = "v1"
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


# ---- config + tokenizer folder ------------------------------------------------------------------

def gguf_meta_folder(gguf_path: Path) -> Path:
    """A cached folder with the GGUF's ``config.json``, tokenizer and generation config (the
    header's BOS / EOS / PAD, as ``loader.gguf_to_folder`` sets them) and no weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from atlas_vlm.checkpoint import build_folder_once, cache_dir
    from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings, gguf_tokenizer_settings

    stat = gguf_path.stat()
    ident = f"{GGUF_META_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    out = cache_dir() / "gguf-meta" / f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out

    def save(tmp: Path) -> None:
        print(f"Reading {gguf_path.name}'s config and tokenizer into {out} (once)...", file=sys.stderr, flush=True)
        kwargs = dict(gguf_file=gguf_path.name)
        config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
        settings = gguf_tokenizer_settings(gguf_path)
        tokenizer = apply_gguf_tokenizer_settings(AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs), settings)
        ids = settings.token_ids
        eos = [ids[k] for k in ("eos", "eot") if k in ids]
        eos = sorted(set(eos), key=eos.index)
        config.save_pretrained(tmp)
        GenerationConfig(bos_token_id=ids.get("bos"), pad_token_id=ids.get("pad"),
                         eos_token_id=eos if len(eos) > 1 else (eos[0] if eos else None)).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_folder_once(out, save)


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


def drop_pages(reader, t) -> None:
    """Drop the resident pages of tensor ``t``'s bytes from ``reader``'s memory map once the
    tensor is converted, so a load's peak RSS does not hold the file beside what was made
    from it (``MADV_DONTNEED`` on a read-only file mapping: a later read faults them back in).
    A no-op where the reader exposes no ``mmap`` (numpy's ``memmap._mmap``) or the OS lacks it."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(int(t.data_offset) + int(t.n_bytes), len(mm))
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


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


def load_gguf_quantized(gguf_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", meta_folder: Path | None = None):
    """Load a ``.gguf`` with its tensors as stored (see the module docstring).

    ``meta_folder``: the config / tokenizer folder to use instead of :func:`gguf_meta_folder`
    (a VLM pair's, whose decoder architecture transformers' GGUF support does not read).

    Returns:
        ``checkpoint.LoadedModel`` (``model_dir``: the :func:`gguf_meta_folder`).

    Raises:
        UnsupportedQuantizationError: a tensor type outside ``SUPPORTED_TYPES`` (named, before
            any decoding), or a fused projection mixing dense and quantized types.
        ValueError: the tensors do not match the config (missing / unexpected names).
    """
    from transformers import AutoConfig, AutoTokenizer

    from atlas_vlm.layers.quant_linear import finalize_quantized, quant_kernel_available
    from atlas_vlm.checkpoint import LoadedModel, read_gguf
    from atlas_vlm.models import ModelArch
    from atlas_vlm.models.registry import model_class, resolve_family, text_config_of

    gguf_path = Path(gguf_path)
    reader = read_gguf(gguf_path)
    check_types(reader.tensors)  # every type before any work
    folder = meta_folder or gguf_meta_folder(gguf_path)
    hf_config = AutoConfig.from_pretrained(folder)
    family = resolve_family(hf_config)
    arch = ModelArch.from_hf_config(hf_config)
    tensors = {t.name: t for t in reader.tensors}
    gguf_arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    model = build_empty(model_class(family), arch, text_config_of(hf_config, family))
    used: set[str] = set()

    layers = tqdm(model.model.layers, desc=f"Loading {gguf_path.name} (as stored)", unit="layer", leave=False)
    for i, layer in enumerate(layers):
        groups: dict[str, list[tuple[str, int | None]]] = {}
        for part, (path, shard) in _PROJ.items():
            groups.setdefault(path, []).append((part, shard))
        for path, parts in groups.items():
            names = [f"blk.{i}.{p}.weight" for p, _ in parts]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"GGUF {gguf_path.name} lacks {missing} for {arch.family}")
            parent = layer.get_submodule(path.rsplit(".", 1)[0])
            attr = path.rsplit(".", 1)[1]
            module = _module_for([tensors[n] for n in names], getattr(parent, attr))
            setattr(parent, attr, module)
            row = 0
            for (part, _), name in zip(parts, names):
                perm = None
                if gguf_arch == "llama" and part in ("attn_q", "attn_k"):
                    heads = arch.num_heads if part == "attn_q" else arch.num_kv_heads
                    perm = _row_permutation(int(tensors[name].shape[-1]), heads)
                row += _load_rows(module, row, tensors[name], perm)
                drop_pages(reader, tensors[name])
                used.add(name)
                bias = name.replace(".weight", ".bias")
                if bias in tensors:
                    b = dense_tensor(tensors[bias])
                    if perm is not None:
                        b = b[perm]
                    module.bias.data[row - b.shape[0]:row].copy_(b)
                    used.add(bias)
            if row != module.out_features:
                raise ValueError(f"GGUF rows of {names} sum to {row}, expected {module.out_features}")
    emb = tensors["token_embd.weight"]
    head = tensors.get("output.weight")
    used.add("token_embd.weight")
    hidden, vocab = arch.hidden_size, arch.vocab_size
    kind = emb.tensor_type.name
    if kind not in DENSE_TYPES:  # one Int8Linear (int8 form) for the embedding's rows, and the LM head if tied
        table = Int8Linear(hidden, vocab, group_size=group_of(kind), has_min=kind in HAS_MIN)
        table.load_rows(0, *int8_form(kind, _rows_of(emb), table.group_size, table.has_min))
        drop_pages(reader, emb)
        model.model.embed_tokens = QuantEmbedding(table, dtype)
        if head is None:
            model.lm_head = table
    materialize(model)
    params = dict(model.named_parameters())
    for i in range(arch.num_layers):
        for part, ours in _PARAM.items():
            name = f"blk.{i}.{part}"
            target = f"model.layers.{i}.{ours}"
            if target in params:
                if name not in tensors:
                    raise ValueError(f"GGUF {gguf_path.name} lacks {name}")
                params[target].data.copy_(dense_tensor(tensors[name]))
                used.add(name)
    params["model.norm.weight"].data.copy_(dense_tensor(tensors["output_norm.weight"]))
    used.add("output_norm.weight")
    if kind in DENSE_TYPES:
        model.model.embed_tokens.weight.data.copy_(dense_tensor(emb))
        if head is None:
            model.lm_head.weight = model.model.embed_tokens.weight
    if head is not None:
        used.add("output.weight")
        lin = _module_for([head], model.lm_head)
        _load_rows(lin, 0, head, None)
        drop_pages(reader, head)
        model.lm_head = lin
    unexpected = sorted(set(tensors) - used - {n for n in tensors if n.startswith("rope_")})
    if unexpected:
        raise ValueError(f"GGUF {gguf_path.name} has tensors {unexpected[:8]} that {arch.family} does not use")
    model.to(device=device, dtype=dtype).eval()
    if isinstance(model.model.embed_tokens, QuantEmbedding):
        model.model.embed_tokens.dtype = dtype
    finalize_quantized(model, quant_kernel_available(device))
    tokenizer = AutoTokenizer.from_pretrained(folder, fix_mistral_regex=False)
    return LoadedModel(model, hf_config, tokenizer, None, folder)
