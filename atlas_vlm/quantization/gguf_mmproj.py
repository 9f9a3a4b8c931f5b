"""VLM GGUF pairs: llama.cpp's language-model GGUF plus its ``mmproj`` GGUF (``--mmproj``).

llama.cpp's converter (``convert_hf_to_gguf.py``, ``conversion/qwenvl.py``) writes a Qwen2-VL /
Qwen2.5-VL checkpoint as two files: the decoder under ``general.architecture`` ``qwen2vl``
(M-RoPE sections in ``qwen2vl.rope.dimension_sections``) and the vision tower under ``clip``
(``clip.projector_type`` ``qwen2vl_merger`` / ``qwen2.5vl_merger``, ``v.*`` / ``mm.*`` tensors,
q/k/v split, the Conv3D patch embedding split in its two temporal halves ``v.patch_embd.weight``
and ``.weight.1``). :func:`gguf_pair_folder` turns such a pair back into an HF folder the loader
reads as any other: ``config.json`` from both headers, the tokenizer and chat template from the
model GGUF, ``preprocessor_config.json`` from the ``clip.vision.*`` keys, the tower's tensors
under their HF names (:mod:`atlas_vlm.quantization.gguf_mmproj_names`), and, for a dense load,
the decoder dequantized (``quantization="gguf"`` keeps it as stored instead).

Values the mmproj header does not hold are the released checkpoints' (Qwen2.5-VL
``window_size`` 112 and ``tokens_per_second`` 2; spatial merge 2; the processor's
``min_pixels`` / ``max_pixels``: the family's ``FamilyHooks.processor_defaults``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from atlas_vlm.models.registry import get_family
from atlas_vlm.quantization.gguf_mmproj_names import GATED_TOWER, check_pair, field, text_state_dict, vision_state_dict

__all__ = ["GGUF_PAIR_VERSION", "gguf_pair_folder"]

GGUF_PAIR_VERSION = "v1"  # part of the cache key: bump when the folder's content changes


def _f32(x) -> float:
    """A header float32 as the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


def _text_config(model, arch: str, n_vocab: int) -> dict:
    sections = [int(x) for x in field(model, f"{arch}.rope.dimension_sections")][:3]
    return dict(vocab_size=n_vocab, hidden_size=int(field(model, f"{arch}.embedding_length")),
                intermediate_size=int(field(model, f"{arch}.feed_forward_length")),
                num_hidden_layers=int(field(model, f"{arch}.block_count")),
                num_attention_heads=int(field(model, f"{arch}.attention.head_count")),
                num_key_value_heads=int(field(model, f"{arch}.attention.head_count_kv")),
                max_position_embeddings=int(field(model, f"{arch}.context_length")),
                rms_norm_eps=_f32(field(model, f"{arch}.attention.layer_norm_rms_epsilon")),
                rope_theta=float(field(model, f"{arch}.rope.freq_base", 10000.0)),
                rope_scaling={"type": "mrope", "mrope_section": sections})


def _vision_config(mm, model_type: str) -> dict:
    width = int(field(mm, "clip.vision.embedding_length"))
    common = dict(depth=int(field(mm, "clip.vision.block_count")), num_heads=int(field(mm, "clip.vision.attention.head_count")),
                  patch_size=int(field(mm, "clip.vision.patch_size")),
                  spatial_merge_size=int(field(mm, "clip.vision.spatial_merge_size", 2)), temporal_patch_size=2,
                  in_channels=3)
    ffn, out = int(field(mm, "clip.vision.feed_forward_length")), int(field(mm, "clip.vision.projection_dim"))
    if not GATED_TOWER[model_type]:
        if ffn % width:
            raise ValueError(f"mmproj: clip.vision.feed_forward_length {ffn} is no multiple of the width {width}, "
                             f"as Qwen2-VL's mlp_ratio needs")
        return dict(common, embed_dim=width, hidden_size=out, mlp_ratio=ffn // width, hidden_act="quick_gelu")
    n_wa = int(field(mm, "clip.vision.n_wa_pattern", common["depth"]))  # full attention every n_wa blocks
    return dict(common, hidden_size=width, intermediate_size=ffn, out_hidden_size=out, hidden_act="silu",
                window_size=112, tokens_per_second=2,
                fullatt_block_indexes=[i for i in range(common["depth"]) if (i + 1) % n_wa == 0])


def _tokenizer(model_path: Path):
    """The model GGUF's tokenizer with llama.cpp's special-token settings and chat template."""
    from transformers import PreTrainedTokenizerFast

    from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings, gguf_tokenizer_settings

    settings = gguf_tokenizer_settings(model_path)
    # the fast tokenizer class reads a GGUF's vocabulary whatever its architecture (AutoTokenizer
    # would first ask transformers' GGUF config support, which has no qwen2vl)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path.parent, gguf_file=model_path.name)
    return apply_gguf_tokenizer_settings(tokenizer, settings), settings


def _token_id(tokenizer, token: str, model_path: Path) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"model GGUF {model_path}: its vocabulary has no {token!r}, which the VLM's prompts need")
    return int(tid)


def _save(tmp: Path, model_path: Path, mmproj_path: Path, model, mm, model_type: str, dense: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig, Qwen2VLImageProcessor

    from atlas_vlm.tokenizer import save_gguf_tokenizer

    tokenizer, settings = _tokenizer(model_path)
    arch = field(model, "general.architecture")
    names = {t.name for t in model.tensors}
    n_vocab = int(next(t for t in model.tensors if t.name == "token_embd.weight").shape[-1])
    ids = settings.token_ids
    eos = [ids[k] for k in ("eos", "eot") if k in ids]
    eos = sorted(set(eos), key=eos.index)
    text = dict(_text_config(model, arch, n_vocab), bos_token_id=ids.get("bos"), eos_token_id=eos[0] if eos else None)
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=_vision_config(mm, model_type),
        tie_word_embeddings="output.weight" not in names, architectures=[get_family(model_type).architectures[0]],
        image_token_id=_token_id(tokenizer, "<|image_pad|>", model_path),
        video_token_id=_token_id(tokenizer, "<|video_pad|>", model_path),
        vision_start_token_id=_token_id(tokenizer, "<|vision_start|>", model_path),
        vision_end_token_id=_token_id(tokenizer, "<|vision_end|>", model_path))
    config.save_pretrained(tmp)
    GenerationConfig(bos_token_id=ids.get("bos"), pad_token_id=ids.get("pad"),
                     eos_token_id=eos if len(eos) > 1 else (eos[0] if eos else None)).save_pretrained(tmp)
    save_gguf_tokenizer(tokenizer, settings, tmp)
    released = get_family(model_type).family_hooks().processor_defaults
    Qwen2VLImageProcessor(image_mean=[_f32(x) for x in field(mm, "clip.vision.image_mean")],
                          image_std=[_f32(x) for x in field(mm, "clip.vision.image_std")],
                          min_pixels=released["min_pixels"], max_pixels=released["max_pixels"],
                          patch_size=config.vision_config.patch_size, merge_size=config.vision_config.spatial_merge_size,
                          temporal_patch_size=2).save_pretrained(tmp)
    visual = {f"visual.{k}": v.contiguous() for k, v in vision_state_dict(mm, model_type, mmproj_path).items()}
    save_file(visual, str(tmp / "vision.safetensors"))
    if dense:
        weights = {k: v.to(torch.float32).contiguous() for k, v in text_state_dict(model).items()}
        save_file(weights, str(tmp / "model.safetensors"))


def gguf_pair_folder(model_path: Path, mmproj_path: Path, *, dense: bool) -> Path:
    """A cached HF folder for the VLM GGUF pair ``model_path`` + ``mmproj_path`` (built once).

    Args:
        model_path: the language model GGUF (llama.cpp's ``qwen2vl`` architecture).
        mmproj_path: its ``mmproj`` GGUF (``general.architecture`` ``clip``).
        dense: also write the decoder's weights, dequantized to fp32 (``model.safetensors``);
            without it the folder holds config, tokenizer, processor and the tower only
            (``vision.safetensors``), for ``quantization="gguf"``.

    Returns:
        the folder (under ``checkpoint.cache_dir()/gguf-pair``, keyed by both files' path, size
        and modification time and ``GGUF_PAIR_VERSION``).

    Raises:
        ModelNotFoundError: a file does not exist.
        ValueError: the pair is not a VLM pair we run, checked before any conversion
            (``gguf_mmproj_names.check_pair``: the file and what is wrong are named).
    """
    from gguf import GGUFReader

    from atlas_vlm.checkpoint import ModelNotFoundError, build_folder_once, cache_dir

    for what, path in (("model", model_path), ("mmproj", mmproj_path)):
        if not path.is_file():
            raise ModelNotFoundError(f"{what} file {path} does not exist")
    model, mm = GGUFReader(str(model_path)), GGUFReader(str(mmproj_path))
    model_type = check_pair(model, mm, model_path, mmproj_path)
    ident = ":".join([GGUF_PAIR_VERSION, str(dense)] + [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                                         for p in (model_path, mmproj_path)])
    out = cache_dir() / "gguf-pair" / f"{model_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out
    return build_folder_once(out, lambda tmp: _save(tmp, model_path, mmproj_path, model, mm, model_type, dense))


