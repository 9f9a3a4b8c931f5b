"""Weight loading: a Hugging Face model folder (config.json + safetensors, sharded too) or a
GGUF file (as stored, memory-mapped: ``quantization.gguf_stored``; with
``quantization="dequantize"`` converted once through transformers' GGUF support and cached as
a dense folder).

HF's separate q/k/v and gate/up projections are stacked into our fused ``qkv_proj`` and
``gate_up_proj`` (row sizes from the model's ``qkv_sizes`` where it has one); Qwen2.5-VL's
``visual.*`` weights are handed back for the vision tower; Qwen3.5's ``mtp.*`` tensors go to
the model's ``mtp_state_dict``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer

from atlas_vlm.checkpoint import (LoadedModel, ModelNotFoundError, build_folder_once, cache_dir, copy_dense, our_name,
                                  read_gguf)
from atlas_vlm.models import CausalLM, ModelArch
from atlas_vlm.models.registry import model_class, resolve_family, text_config_of
from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings, eos_token_ids, gguf_tokenizer_settings, save_gguf_tokenizer

__all__ = ["GGUF_CONVERSION_VERSION", "LoadedModel", "ModelNotFoundError", "build_folder_once", "cache_dir", "copy_dense",
           "eos_token_ids", "gguf_to_folder", "load_model", "our_name"]

#: Part of the converted folder's cache key: bump when the conversion changes, so that stale
#: folders in the cache are not reused (v2: tokenizer settings taken from the GGUF header).
GGUF_CONVERSION_VERSION = "v4"  # v4: saved by transformers 5, tokenizer settings written


def gguf_to_folder(gguf_path: Path) -> Path:
    """Dequantize a GGUF checkpoint to an HF folder (fp32 safetensors + tokenizer), once.

    Uses ``transformers``' GGUF support (``from_pretrained(..., gguf_file=...)``), then sets the
    tokenizer's special tokens, ``add_bos_token`` / ``add_eos_token``,
    ``clean_up_tokenization_spaces`` and chat template, and the generation config's
    BOS/EOS/PAD ids, as the GGUF header states them (:mod:`atlas_vlm.tokenizer`). The folder
    is keyed by the file's path, size, modification time and ``GGUF_CONVERSION_VERSION``.
    """
    stat = gguf_path.stat()
    ident = f"{GGUF_CONVERSION_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").exists():
        return out
    read_gguf(gguf_path)  # a truncated or corrupt file named in one line before any conversion
    from transformers import AutoModelForCausalLM

    print(f"Converting {gguf_path.name} to {out} (once)...", file=sys.stderr, flush=True)
    kwargs = dict(gguf_file=gguf_path.name)
    settings = gguf_tokenizer_settings(gguf_path)
    tokenizer = apply_gguf_tokenizer_settings(AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs), settings)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    ids = settings.token_ids
    gen = hf_model.generation_config
    gen.bos_token_id = ids.get("bos")
    eos = [ids[k] for k in ("eos", "eot") if k in ids]
    gen.eos_token_id = sorted(set(eos), key=eos.index) if len(set(eos)) > 1 else (eos[0] if eos else None)
    gen.pad_token_id = ids.get("pad")

    # transformers 5 marks a GGUF-loaded model as quantized and refuses to save it; its
    # weights are already dequantized to fp32, so the marks go before saving
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config

    def save(tmp: Path) -> None:
        hf_model.save_pretrained(tmp)
        save_gguf_tokenizer(tokenizer, settings, tmp)

    return build_folder_once(out, save)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model folder {model_dir} holds no *.safetensors weights")
    return files


_our_name = our_name  # the old private name (tests/parity/test_real_vlm_geometry.py)


def _load_weights(model: CausalLM, files: list[Path]) -> dict[str, torch.Tensor]:
    from atlas_vlm.layers.quant_linear import quantized_modules

    params = dict(model.named_parameters())
    qids = {id(m) for m in quantized_modules(model)}  # quantized at load: dense rows -> module.load_dense_rows
    quant = {f"{n}.weight": m for n, m in model.named_modules() if id(m) in qids}
    loaded: set[str] = set()
    unexpected, visual = [], {}
    arch = model.arch
    # rows of q / k / v in the fused qkv_proj: the model's own sizes where it has them (Qwen3.5's
    # q_proj is query + gate), else heads x head_dim / kv_heads x head_dim
    qkv_sizes = model.qkv_sizes or \
        [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2
    mtp = model.mtp_state_dict  # declared (CausalLM): a model that keeps the checkpoint's mtp.* tensors
    for path in tqdm(files, desc="Loading safetensors", unit="file", leave=False):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                kind, name, shard = our_name(hf_name)
                if kind == "visual":
                    visual[name] = f.get_tensor(hf_name)
                    continue
                if kind is None:
                    continue
                if mtp is not None and hf_name.startswith("mtp."):  # Qwen3.5's multi-token prediction head
                    mtp[hf_name[len("mtp."):]] = f.get_tensor(hf_name)
                    continue
                if name in quant:
                    _load_quantized_rows(quant[name], name, shard, f.get_tensor(hf_name), arch, qkv_sizes, loaded)
                    continue
                if name not in params:
                    unexpected.append(hf_name)
                    continue
                loaded.add(copy_dense(params[name].data, name, shard, f.get_tensor(hf_name), hf_name, arch, qkv_sizes))
    expected = set()
    for name in list(params) + list(quant):
        if "qkv_proj.weight" in name or "qkv_proj.bias" in name:
            expected |= {f"{name}#{i}" for i in range(3)}
        elif "gate_up_proj" in name:
            expected |= {f"{name}#{i}" for i in range(2)}
        else:
            expected.add(name)
    if arch.tie_word_embeddings:
        expected.discard("lm_head.weight")
        loaded.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {arch.family}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    return visual


def _load_quantized_rows(module, name: str, shard: int | None, tensor: torch.Tensor, arch, qkv_sizes,
                         loaded: set[str]) -> None:
    """Quantize-at-load: one HF weight (a q/k/v or gate/up shard, or a whole projection) into
    its rows of a quantized module."""
    row = 0
    if shard is not None:
        sizes = qkv_sizes if "qkv_proj" in name else [arch.intermediate_size] * 2
        row = sum(sizes[:shard])
        name = f"{name}#{shard}"
    module.load_dense_rows(row, tensor)
    loaded.add(name)


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               revision: str | None = None, quantization: str | None = None,
               mmproj: str | os.PathLike | None = None, hf_file: str | None = None) -> LoadedModel:
    """Load config, tokenizer and weights of a supported model.

    Args:
        path: an HF model folder (``config.json`` + ``*.safetensors``), a ``.gguf`` file (a
            split one's parts ``-0000i-of-0000n.gguf`` read as one), or a Hub id ``ORG/NAME`` /
            a GGUF repo's ``ORG/NAME-GGUF[:QUANT]`` (``atlas_vlm.hub.resolve_model``; a local
            path wins; a GGUF repo's ``mmproj`` is paired unless ``mmproj`` is given).
        dtype: parameter dtype (``EngineConfig.torch_dtype``: bf16 on CUDA and on CPUs with
            AMX/AVX512-BF16, else fp32).
        revision: Hub branch / tag / commit for a Hub id.
        quantization: None (as stored: a folder dense, a .gguf's blocks in place), "int8" /
            "int4" (quantized at load, round to nearest), "gguf" (a .gguf as stored, as None),
            "gguf_int" (a .gguf converted exactly to our int8 / int4 tiles),
            "dequantize" (a .gguf converted once to a dense fp32 folder in the cache), "awq" /
            "gptq" (the checkpoint's own ``quantization_config`` is read and honoured either
            way); see :mod:`atlas_vlm.quantization`.
        mmproj: llama.cpp's ``mmproj`` GGUF of the VLM whose language model ``path`` (a
            ``.gguf``) is: the pair is loaded as one VLM (:mod:`atlas_vlm.quantization.gguf_mmproj`).
        hf_file: the GGUF file of a Hub GGUF repo ``path`` to load (llama.cpp's ``--hf-file``).

    Raises:
        ModelNotFoundError: ``path`` (or ``mmproj``) does not exist or has no config/weights.
        UnsupportedModelError: the architecture is not in ``registry.SUPPORTED_ARCHITECTURES``.
        ValueError: the weights do not match the config.
        UnsupportedQuantizationError: an unknown scheme, a checkpoint quantization method or
            GGUF tensor type we do not run (named), or a scheme that does not fit the file.
    """
    from atlas_vlm.hub import resolve_model
    from atlas_vlm.quantization import check_quantization
    from atlas_vlm.quantization.gguf_split import merged_gguf

    check_quantization(quantization)

    path, hub_mmproj = resolve_model(path, revision, hf_file)
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist; pass an HF model folder, a .gguf file "
                                 f"or a Hugging Face Hub id ORG/NAME (a GGUF repo: ORG/NAME-GGUF:Q4_K_M)")
    if path.is_file() and path.suffix == ".gguf":
        path = merged_gguf(path)  # a split file's parts as one file
    mmproj = mmproj if mmproj is not None else hub_mmproj
    if mmproj is not None:
        return _load_gguf_pair(path, Path(mmproj).expanduser(), dtype, device, quantization)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {path} is not a .gguf file; pass an HF model folder or a .gguf file")
        if quantization in (None, "gguf", "gguf_int"):
            return _load_gguf(path, quantization, dtype, device)
        path = gguf_to_folder(path)  # the dense copy: "dequantize", or "int8" / "int4" quantized from it
        quantization = None if quantization == "dequantize" else quantization
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"model folder {path} has no config.json")
    hf_config = AutoConfig.from_pretrained(path)
    arch = ModelArch.from_hf_config(hf_config)
    files = _checkpoint_files(path)
    family = resolve_family(hf_config)
    from atlas_vlm.quantization import resolve_quantization

    method, quant_config = resolve_quantization(quantization, hf_config)
    if method is not None and not model_class(family).quantizable:  # declared (CausalLM)
        from atlas_vlm.quantization import UnsupportedQuantizationError

        raise UnsupportedQuantizationError(f"quantization={method!r} is not supported for {family.name} yet; "
                                           "load it dense (quantization=None)")
    if method is None:
        from atlas_vlm.quantization import build_empty, materialize

        # as quantized loads (gpt-fast): built on ``meta``, storage made once in the target
        # dtype, the checkpoint copied in (copy_ rounds as .to(dtype) would): no init, no fp32 copy
        model = build_empty(model_class(family), arch, text_config_of(hf_config, family))
        materialize(model, device, dtype)
        visual = _load_weights(model, files)
    else:
        from atlas_vlm.quantization.build import load_quantized_weights

        model, visual = load_quantized_weights(model_class(family), arch, text_config_of(hf_config, family), files,
                                               method, quant_config, _load_weights)
    model.to(device=device, dtype=dtype).eval()
    if method is not None:
        from atlas_vlm.layers.quant_linear import finalize_quantized, quant_kernel_available

        finalize_quantized(model, quant_kernel_available(device))
    # transformers 4.57.3-4.57.x flags every local tokenizer saved by those versions as a
    # Mistral one with a bad regex (a false positive); saying False keeps it as it is, quietly.
    tokenizer = AutoTokenizer.from_pretrained(path, fix_mistral_regex=False)
    from atlas_vlm.models.processor_settings import image_processor_settings

    settings = image_processor_settings(path, hf_config) if family.multimodal else None
    visual = visual if family.multimodal else None  # a family registered text-only has no tower to take them
    return LoadedModel(model, hf_config, tokenizer, visual or None, path, settings)


def _load_gguf(path: Path, quantization: str | None, dtype, device, meta_folder: Path | None = None) -> LoadedModel:
    """A ``.gguf`` as stored on CPU (``gguf_stored``); converted to our int8 / int4 tiles
    (``gguf_converted``) with ``quantization="gguf_int"``, and on a GPU (whose matmuls read those
    tiles) with ``"gguf"``; on a GPU with None the dense copy as before (a pair: its ``meta_folder``)."""
    if torch.device(device).type == "cpu" and quantization != "gguf_int":
        from atlas_vlm.quantization.gguf_stored import FamilyNotStoredError, load_gguf_stored

        try:
            return load_gguf_stored(path, dtype=dtype, device=device, meta_folder=meta_folder)
        except FamilyNotStoredError as e:
            if quantization is not None or meta_folder is not None:
                raise
            print(f"{e}: loading the dense copy", file=sys.stderr, flush=True)
            return load_model(gguf_to_folder(path), dtype=dtype, device=device)
    if quantization in ("gguf", "gguf_int") or meta_folder is not None:
        from atlas_vlm.quantization.gguf_converted import load_gguf_converted

        return load_gguf_converted(path, dtype=dtype, device=device, meta_folder=meta_folder)
    return load_model(gguf_to_folder(path), dtype=dtype, device=device)


def _load_gguf_pair(path: Path, mmproj: Path, dtype, device, quantization: str | None) -> LoadedModel:
    """A VLM from a model GGUF + its mmproj GGUF: the decoder as stored (None / "gguf"), or
    dequantized to a dense folder ("dequantize"); the tower from the mmproj."""
    from atlas_vlm.quantization.gguf_mmproj import gguf_pair_folder

    if not path.is_file() or path.suffix != ".gguf":
        raise ValueError(f"mmproj {mmproj} needs the model to be its language model .gguf file, got {path}")
    if quantization not in (None, "gguf", "gguf_int", "dequantize"):
        raise ValueError(f"quantization={quantization!r} does not apply to a GGUF pair: use None / 'gguf' (as "
                         f"stored) or 'dequantize'")
    dense = quantization == "dequantize" or (quantization is None and torch.device(device).type != "cpu")
    folder = gguf_pair_folder(path, mmproj, dense=dense)
    if dense:
        return load_model(folder, dtype=dtype, device=device)
    from atlas_vlm.models.processor_settings import image_processor_settings

    loaded = _load_gguf(path, quantization, dtype, device, meta_folder=folder)
    with safe_open(str(folder / "vision.safetensors"), framework="pt") as f:
        loaded.vision_state_dict = {k[len("visual."):]: f.get_tensor(k) for k in f.keys()}
    loaded.image_settings = image_processor_settings(folder, loaded.hf_config)
    return loaded
