"""GGUF tensors as stored (``quantization="gguf"``): read with the ``gguf`` package's
``GGUFReader`` (memory-mapped), each block format mapped exactly onto our modules, no dense
copy of a quantized tensor.

=========  ======================================  ==============================================
GGUF type  block                                    module (``W`` as the GGUF defines it)
=========  ======================================  ==============================================
Q8_0       32 int8 ``q`` + fp16 ``d``               ``Int8Linear`` group 32: ``d * q``
Q4_0       32 nibbles + fp16 ``d``                  ``Int4Linear`` group 32: scale ``d``, min ``-8 d``
Q4_1       32 nibbles + fp16 ``d``, ``m``           ``Int4Linear`` group 32: ``d``, ``m``
Q4_K       256: 8 x 32 nibbles, 6-bit scales and    ``Int4Linear`` group 32: ``d sc``,
           mins, fp16 ``d``, ``dmin``               ``-dmin m``
F32 / F16  dense                                    ``nn.Linear`` / parameter
=========  ======================================  ==============================================

Any other type (Q5_*, Q6_K, Q2_K, ...) is refused at load with the tensor's name and type.
A fused projection (q/k/v, gate/up) whose parts mix an int8 and an int4 type is refused too.
A Q8_0 embedding (SmolLM2's ``token_embd``, tied to the LM head) stays int8: the LM head is
the ``Int8Linear`` and lookups dequantize their rows (``QuantEmbedding``).
Config and tokenizer come from the GGUF header through ``transformers``, saved once as a small
folder without weights (``gguf_meta_folder``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear, QuantEmbedding
from atlas_vlm.quantization import UnsupportedQuantizationError, build_empty, materialize

GGUF_META_VERSION = "v1"
INT8_TYPES = ("Q8_0",)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
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


# ---- block decoders (numpy uint8 rows -> torch) -------------------------------------------------

def _f16(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16).astype(np.float32))


def decode_q8_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows ``[N, K / 32 * 34]`` uint8 -> ``q`` int8 ``[N, K]``, ``scales`` fp32 ``[N, K / 32]``."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 34)
    d = _f16(blocks[..., :2]).view(n, -1)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(n, -1)
    return q, d


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 values: bytes' low nibbles first, then high (ggml Q4_0 / Q4_1)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def decode_q4_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 rows -> ``q`` uint8 ``[N, K]`` (0..15), ``scales``, ``mins`` fp32 ``[N, K / 32]``
    (``W = (q - 8) d``: scale ``d``, min ``-8 d``)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 18)
    d = _f16(blocks[..., :2]).view(n, -1)
    q = torch.from_numpy(_nibbles32(blocks[..., 2:])).reshape(n, -1)
    return q, d, -8.0 * d


def decode_q4_1(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows -> ``q`` ``[N, K]``, ``scales``, ``mins`` ``[N, K / 32]`` (``W = d q + m``)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 20)
    d = _f16(blocks[..., :2]).view(n, -1)
    m = _f16(blocks[..., 2:4]).view(n, -1)
    q = torch.from_numpy(_nibbles32(blocks[..., 4:])).reshape(n, -1)
    return q, d, m


def decode_q4_k(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows (super-blocks of 256 = 8 groups of 32) -> ``q`` ``[N, K]``, ``scales``,
    ``mins`` ``[N, K / 32]`` (``W = d sc q - dmin m`` per group)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 144)
    d = _f16(blocks[..., :2]).view(n, -1, 1)  # [N, S, 1]
    dmin = _f16(blocks[..., 2:4]).view(n, -1, 1)
    sc_bytes = blocks[..., 4:16].astype(np.int32)  # [N, S, 12]
    lo = sc_bytes[..., :4]
    mid = sc_bytes[..., 4:8]
    hi = sc_bytes[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)  # [N, S, 8]
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 64 values: 32 low nibbles, then 32 high
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1)
    scale = d * torch.from_numpy(sc.astype(np.float32))  # [N, S, 8]
    mins = -dmin * torch.from_numpy(mn.astype(np.float32))
    return torch.from_numpy(q), scale.reshape(n, -1), mins.reshape(n, -1)


DECODERS = {"Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q4_K": decode_q4_k}


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

    from atlas_vlm.loader import build_folder_once, cache_dir
    from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings, gguf_tokenizer_settings

    stat = gguf_path.stat()
    ident = f"{GGUF_META_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    out = cache_dir() / "gguf-meta" / f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out

    def save(tmp: Path) -> None:
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


def _module_for(parts: list, linear: nn.Linear) -> nn.Module:
    kinds = {t.tensor_type.name for t in parts}
    for t in parts:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedQuantizationError(f"GGUF tensor {t.name} has type {t.tensor_type.name}; supported: "
                                               f"{', '.join(SUPPORTED_TYPES)}")
    if kinds <= set(DENSE_TYPES):
        return nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    if kinds <= set(INT4_TYPES):
        return Int4Linear(linear.in_features, linear.out_features, linear.bias is not None, group_size=32)
    if kinds <= set(INT8_TYPES):
        return Int8Linear(linear.in_features, linear.out_features, linear.bias is not None, group_size=32)
    raise UnsupportedQuantizationError(f"GGUF tensors {[t.name for t in parts]} of one fused projection mix types "
                                       f"{sorted(kinds)}; Atlas VLM needs one int8 or one int4 kind per projection")


def _load_rows(module: nn.Module, row: int, t, perm: torch.Tensor | None) -> int:
    kind = t.tensor_type.name
    if kind in DENSE_TYPES:
        w = dense_tensor(t)
        if perm is not None:
            w = w[perm]
        module.weight.data[row:row + w.shape[0]].copy_(w)
        return w.shape[0]
    q, *scales = DECODERS[kind](_rows_of(t))  # int8: scales; int4: scales, mins ([N, groups] each)
    if perm is not None:
        q, scales = q[perm], [s[perm] for s in scales]
    module.load_rows(row, q, *scales)
    return q.shape[0]


def load_gguf_quantized(gguf_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu"):
    """Load a ``.gguf`` with its tensors as stored (see the module docstring).

    Returns:
        ``loader.LoadedModel`` (``model_dir``: the :func:`gguf_meta_folder`).

    Raises:
        UnsupportedQuantizationError: a tensor type outside ``SUPPORTED_TYPES`` (named), or a
            fused projection mixing int8 and int4 types.
        ValueError: the tensors do not match the config (missing / unexpected names).
    """
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    from atlas_vlm.layers.quant_linear import finalize_quantized, quant_kernel_available
    from atlas_vlm.loader import LoadedModel
    from atlas_vlm.models import ModelArch
    from atlas_vlm.models.registry import model_class, resolve_family, text_config_of

    gguf_path = Path(gguf_path)
    folder = gguf_meta_folder(gguf_path)
    hf_config = AutoConfig.from_pretrained(folder)
    family = resolve_family(hf_config)
    arch = ModelArch.from_hf_config(hf_config)
    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    gguf_arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    model = build_empty(model_class(family), arch, text_config_of(hf_config, family))
    used: set[str] = set()

    for i, layer in enumerate(model.model.layers):
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
    tied_int8 = emb.tensor_type.name in INT8_TYPES and head is None
    if tied_int8:  # tied, int8: one Int8Linear for the LM head and the embedding's rows
        table = Int8Linear(hidden, vocab, group_size=32)
        table.load_rows(0, *decode_q8_0(_rows_of(emb)))
        model.lm_head = table
        model.model.embed_tokens = QuantEmbedding(table, dtype)
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
    if not tied_int8:
        if emb.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedQuantizationError(f"GGUF tensor token_embd.weight has type {emb.tensor_type.name}; "
                                               f"supported: {', '.join(SUPPORTED_TYPES)}")
        if emb.tensor_type.name in DENSE_TYPES:
            model.model.embed_tokens.weight.data.copy_(dense_tensor(emb))
        else:  # an int4 / separate int8 embedding: its rows dequantized once (one dense tensor)
            from gguf.quants import dequantize

            w = dequantize(np.asarray(emb.data), emb.tensor_type).reshape(vocab, hidden)
            model.model.embed_tokens.weight.data.copy_(torch.from_numpy(np.ascontiguousarray(w)))
        if head is None:
            model.lm_head.weight = model.model.embed_tokens.weight
        else:
            used.add("output.weight")
            lin = _module_for([head], model.lm_head)
            _load_rows(lin, 0, head, None)
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
