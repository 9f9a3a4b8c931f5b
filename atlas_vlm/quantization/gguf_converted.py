"""A ``.gguf`` converted at load to our ``Int4Linear`` / ``Int8Linear`` (exact, ``gguf``'s
decoders: :mod:`atlas_vlm.quantization.gguf`): what ``quantization="gguf"`` loads on a GPU,
whose Triton matmuls read those tiles (the stored-block layers of ``gguf_stored`` are CPU code).
A quantized ``token_embd`` stays quantized as an ``Int8Linear`` in its int8 form (lookups
dequantize their rows: ``QuantEmbedding``; tied, it is the LM head). Config and tokenizer come
from the header, in memory (``gguf_meta``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from atlas_vlm.layers.quant_linear import Int8Linear, QuantEmbedding
from atlas_vlm.quantization import build_empty, materialize
from atlas_vlm.quantization.gguf import (_PROJ, DENSE_TYPES, _load_rows, _module_for, _row_permutation, copy_dense_params,
                                         _rows_of, check_types, dense_tensor, drop_pages)
from atlas_vlm.quantization.gguf_types import HAS_MIN, group_of, int8_form

__all__ = ["load_gguf_converted"]


def load_gguf_converted(gguf_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", meta_folder: Path | None = None):
    """Load a ``.gguf`` converted to our int8 / int4 tiles (see the module docstring).

    ``meta_folder``: a config / tokenizer folder to use instead of the header (a VLM pair's,
    whose decoder architecture transformers' GGUF support does not read).

    Returns:
        ``checkpoint.LoadedModel`` (``model_dir``: ``meta_folder``, else the ``.gguf``).

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
    from atlas_vlm.quantization.gguf_meta import gguf_config, gguf_tokenizer
    from atlas_vlm.tokenizer import gguf_tokenizer_settings

    gguf_path = Path(gguf_path)
    reader = read_gguf(gguf_path)
    check_types(reader.tensors)  # every type before any work
    hf_config = AutoConfig.from_pretrained(meta_folder) if meta_folder else gguf_config(reader, gguf_path)
    family = resolve_family(hf_config)
    arch = ModelArch.from_hf_config(hf_config)
    tensors = {t.name: t for t in reader.tensors}
    gguf_arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    model = build_empty(model_class(family), arch, text_config_of(hf_config, family))
    used: set[str] = set()

    layers = tqdm(model.model.layers, desc=f"Converting {gguf_path.name} to int tiles", unit="layer", leave=False)
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
    copy_dense_params(params, tensors, arch.num_layers, gguf_path.name, used)
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
    if meta_folder:
        tokenizer = AutoTokenizer.from_pretrained(meta_folder, fix_mistral_regex=False)
    else:
        tokenizer = gguf_tokenizer(reader, hf_config, gguf_tokenizer_settings(gguf_path, reader.fields))
    return LoadedModel(model, hf_config, tokenizer, None, meta_folder or gguf_path)
