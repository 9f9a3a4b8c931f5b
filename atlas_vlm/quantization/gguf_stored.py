"""A ``.gguf`` loaded as stored (the default for a GGUF; ``quantization="gguf"`` says the same):
the file is memory-mapped by ``gguf.GGUFReader`` and every 2-D quantized tensor is a layer on
its own bytes (``layers.gguf_stored.stored_linear``: ``GGUFLinear``'s stored-block kernels for
Q4_K / Q5_K / Q6_K / Q8_0, else ``GGUFDequantLinear``), nothing converted, nothing written to
the cache; config and tokenizer from the header, in memory (``gguf_meta``).

Copies, each once, into anonymous memory (the file's pages of a copied tensor are dropped):
a fused projection whose parts share one type (q/k/v, gate/up: rows are independent, so the
parts' rows are concatenated), and llama.cpp's permuted Q/K rows of a ``llama`` file put back
in HF's order. A fused projection of mixed types (Q4_K_M's Q6_K ``attn_v``) keeps each part on
the file's pages (``GGUFFusedLinear``). Types without a stored-block kernel (and kernel types
whose rows are not whole 256-value super-blocks) are dequantized once into memory in the
model's dtype: as fast as dense, held dense. A quantized ``token_embd`` looks up rows by
dequantizing those rows only (``GGUFEmbedding``); tied (no ``output.weight``) it is the LM head
through the same stored bytes. F32 / F16 / BF16 tensors (norms, biases, a dense file's
weights) are copied as fp32 / the model's dtype.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from atlas_vlm.layers.gguf_stored import GGUFDequantLinear, GGUFEmbedding, GGUFFusedLinear, stored_linear
from atlas_vlm.quantization import UnsupportedQuantizationError, build_empty, materialize
from atlas_vlm.quantization.gguf import (_PROJ, DENSE_TYPES, _row_permutation, check_types, copy_dense_params, dense_tensor,
                                         drop_pages)

__all__ = ["FamilyNotStoredError", "load_gguf_stored"]


class FamilyNotStoredError(UnsupportedQuantizationError):
    """The model family has no as-stored GGUF load yet (a hybrid decoder: Qwen3.5)."""


def _blocks(t) -> torch.Tensor:
    """A quantized tensor's bytes ``[N, bytes per row]`` (uint8), a view of the mapped file."""
    import warnings

    n = int(t.shape[-1]) if len(t.shape) > 1 else 1
    with warnings.catch_warnings():  # the map is read-only; nothing writes it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(t.data).view(n, -1)


def _projection(reader, parts: list, perms: list, biases: list, in_features: int, dtype) -> nn.Module:
    """One projection's module from its GGUF ``parts`` (in output-row order; ``perms``: a row
    order to apply or None; ``biases``: fp32 or None each)."""
    kinds = {t.tensor_type.name for t in parts}
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(int(t.shape[-1])) for b, t in zip(biases, parts)])
    if kinds <= set(DENSE_TYPES):
        ws = [dense_tensor(t) if p is None else dense_tensor(t)[p] for t, p in zip(parts, perms)]
        w = torch.cat(ws) if len(ws) > 1 else ws[0]  # [N, K]
        lin = nn.Linear(in_features, w.shape[0], bias=bias is not None, device="meta")  # no init
        lin.weight = nn.Parameter(w.to(dtype))
        lin.bias = None if bias is None else nn.Parameter(bias.to(dtype))
        return lin
    if len(kinds) == 1 and (len(parts) > 1 or perms[0] is not None):
        # one type: the parts' rows (reordered) concatenated once into anonymous memory
        rows = [_blocks(t) if p is None else _blocks(t)[p] for t, p in zip(parts, perms)]
        blocks = torch.cat(rows) if len(rows) > 1 else rows[0].contiguous()  # [sum N, bytes per row]
        for t in parts:
            drop_pages(reader, t)
        mod = stored_linear(blocks, kinds.pop(), in_features, blocks.shape[0], bias)
        if getattr(mod, "packed", None) is not None:  # the interleaved copy runs: the concatenation would
            mod.blocks = None  # only double the memory
        return mod
    if len(parts) == 1:
        mod = stored_linear(_blocks(parts[0]), parts[0].tensor_type.name, in_features, int(parts[0].shape[-1]), bias)
        if getattr(mod, "packed", None) is not None:  # the interleaved copy runs: the file's pages can go
            drop_pages(reader, parts[0])
        return mod
    mods = [_projection(reader, [t], [p], [b], in_features, dtype)  # mixed types: one module per part
            for t, p, b in zip(parts, perms, biases)]
    return GGUFFusedLinear(mods)


def load_gguf_stored(gguf_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", meta_folder: Path | None = None):
    """Load a ``.gguf`` as stored (see the module docstring).

    Args:
        gguf_path: the file.
        dtype: the model's dtype (activations; dense and dequantized weights).
        device: "cpu" (the stored-block kernels are CPU code).
        meta_folder: a folder with ``config.json`` + tokenizer to use instead of the header
            (a VLM pair's, whose decoder architecture transformers' GGUF support does not read).

    Returns:
        ``checkpoint.LoadedModel`` (``model_dir``: ``meta_folder``, else the ``.gguf`` itself).

    Raises:
        GGUFFileError: a truncated or corrupt file (``checkpoint.read_gguf``).
        UnsupportedQuantizationError: a tensor type ``gguf`` cannot read (named, before any work).
        FamilyNotStoredError: a family without plain decoder layers (Qwen3.5).
        ValueError: the tensors do not match the config (missing / unexpected names), or a
            device other than CPU.
    """
    from transformers import AutoConfig, AutoTokenizer

    from atlas_vlm.checkpoint import LoadedModel, read_gguf
    from atlas_vlm.models import ModelArch
    from atlas_vlm.models.registry import model_class, resolve_family, text_config_of
    from atlas_vlm.quantization.gguf_meta import gguf_config, gguf_tokenizer
    from atlas_vlm.tokenizer import gguf_tokenizer_settings

    gguf_path = Path(gguf_path)
    if torch.device(device).type != "cpu":
        raise ValueError(f"a GGUF as stored runs on CPU (device {device}); load it with quantization='dequantize'")
    reader = read_gguf(gguf_path)
    check_types(reader.tensors)  # every type before any work
    hf_config = AutoConfig.from_pretrained(meta_folder) if meta_folder else gguf_config(reader, gguf_path)
    family = resolve_family(hf_config)
    if not model_class(family).quantizable:  # declared (CausalLM): plain decoder layers
        raise FamilyNotStoredError(f"GGUF {gguf_path.name}: {family.name} does not load as stored yet; use "
                                   f"quantization='dequantize'")
    arch = ModelArch.from_hf_config(hf_config)
    tensors = {t.name: t for t in reader.tensors}
    gguf_arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    model = build_empty(model_class(family), arch, text_config_of(hf_config, family))
    used: set[str] = set()
    for i, layer in enumerate(model.model.layers):
        groups: dict[str, list[str]] = {}
        for part, (path, _) in _PROJ.items():
            groups.setdefault(path, []).append(part)
        for path, group in groups.items():
            names = [f"blk.{i}.{p}.weight" for p in group]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"GGUF {gguf_path.name} lacks {missing} for {arch.family}")
            perms, biases = [], []
            for part, name in zip(group, names):
                perm = None
                if gguf_arch == "llama" and part in ("attn_q", "attn_k"):
                    heads = arch.num_heads if part == "attn_q" else arch.num_kv_heads
                    perm = _row_permutation(int(tensors[name].shape[-1]), heads)
                bias = name.replace(".weight", ".bias")
                b = dense_tensor(tensors[bias]) if bias in tensors else None
                biases.append(b if b is None or perm is None else b[perm])
                perms.append(perm)
                used |= {name} | ({bias} if bias in tensors else set())
            parent, attr = layer.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
            module = _projection(reader, [tensors[n] for n in names], perms, biases, getattr(parent, attr).in_features,
                                 dtype)
            if module.out_features != getattr(parent, attr).out_features:
                raise ValueError(f"GGUF rows of {names} sum to {module.out_features}, expected "
                                 f"{getattr(parent, attr).out_features}")
            setattr(parent, attr, module)
    emb, head = tensors["token_embd.weight"], tensors.get("output.weight")
    used |= {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if head is not None else set())
    stored_emb = emb.tensor_type.name not in DENSE_TYPES
    if stored_emb:
        model.model.embed_tokens = GGUFEmbedding(_blocks(emb), emb.tensor_type.name, arch.hidden_size, dtype)
    if head is not None or stored_emb:
        model.lm_head = _projection(reader, [head if head is not None else emb], [None], [None], arch.hidden_size, dtype)
    materialize(model)
    params = dict(model.named_parameters())
    copy_dense_params(params, tensors, arch.num_layers, gguf_path.name, used)
    if not stored_emb:
        model.model.embed_tokens.weight.data.copy_(dense_tensor(emb))
        if head is None:
            model.lm_head.weight = model.model.embed_tokens.weight
    unexpected = sorted(set(tensors) - used - {n for n in tensors if n.startswith("rope_")})
    if unexpected:
        raise ValueError(f"GGUF {gguf_path.name} has tensors {unexpected[:8]} that {arch.family} does not use")
    model.to(dtype=dtype).eval()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GGUFDequantLinear):  # no stored-block kernel: its dense copy, a plain
                setattr(parent, name, child.to_linear(dtype))  # nn.Linear (packed / batch-invariant paths)
            elif isinstance(child, GGUFEmbedding):
                child.dtype = dtype
    if meta_folder:
        tokenizer = AutoTokenizer.from_pretrained(meta_folder, fix_mistral_regex=False)
    else:
        tokenizer = gguf_tokenizer(reader, hf_config, gguf_tokenizer_settings(gguf_path, reader.fields))
    return LoadedModel(model, hf_config, tokenizer, None, meta_folder or gguf_path)
