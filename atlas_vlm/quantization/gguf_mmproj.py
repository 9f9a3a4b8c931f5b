"""VLM GGUF pairs: llama.cpp's language-model GGUF plus its ``mmproj`` GGUF (``--mmproj``).

llama.cpp's converter (``convert_hf_to_gguf.py --mmproj``) writes a VLM as two files: the
decoder under its own ``general.architecture`` (``qwen2vl``: Qwen2-VL / Qwen2.5-VL, with M-RoPE
sections in ``qwen2vl.rope.dimension_sections``; ``qwen3vl``: Qwen3-VL; ``llama``: SmolVLM2) and
the vision tower under ``clip`` (``clip.projector_type`` ``qwen2vl_merger`` / ``qwen2.5vl_merger``
/ ``qwen3vl_merger`` / ``idefics3``, ``v.*`` / ``mm.*`` tensors). :func:`gguf_pair_folder` turns
such a pair back into an HF folder the loader reads as any other: ``config.json`` from both
headers, the tokenizer and chat template from the model GGUF, the processor from the
``clip.vision.*`` keys, the tower's tensors under their HF names, and, for a dense load, the
decoder dequantized (``quantization="gguf"`` keeps it as stored instead). What is each
projector's own (its tower's names, ``vision_config``, processor, image tokens) lives in
:mod:`atlas_vlm.quantization.gguf_mmproj_qwen` and :mod:`atlas_vlm.quantization.gguf_mmproj_idefics3`
(``PAIRS``); the family's released processor defaults come from its hooks
(``FamilyHooks.processor_defaults``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from atlas_vlm.models.registry import get_family
from atlas_vlm.quantization.gguf_mmproj_idefics3 import IDEFICS3
from atlas_vlm.quantization.gguf_mmproj_names import check_pair, f32, field, text_state_dict
from atlas_vlm.quantization.gguf_mmproj_qwen import QWEN2_5_VL, QWEN2_VL, QWEN3_VL

__all__ = ["GGUF_PAIR_VERSION", "PAIRS", "gguf_pair_folder"]

GGUF_PAIR_VERSION = "v2"  # part of the cache key: bump when the folder's content changes
#: HF ``model_type`` (``gguf_mmproj_names.PROJECTORS``' values) -> its projector's layout
PAIRS = {"qwen2_vl": QWEN2_VL, "qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL, "smolvlm": IDEFICS3}


def _text_config(model, arch: str, n_vocab: int) -> dict:
    """The decoder's HF ``text_config`` fields every pair shares (``{arch}.*`` keys)."""
    text = dict(vocab_size=n_vocab, hidden_size=int(field(model, f"{arch}.embedding_length")),
                intermediate_size=int(field(model, f"{arch}.feed_forward_length")),
                num_hidden_layers=int(field(model, f"{arch}.block_count")),
                num_attention_heads=int(field(model, f"{arch}.attention.head_count")),
                num_key_value_heads=int(field(model, f"{arch}.attention.head_count_kv")),
                max_position_embeddings=int(field(model, f"{arch}.context_length")),
                rms_norm_eps=f32(field(model, f"{arch}.attention.layer_norm_rms_epsilon")),
                rope_theta=float(field(model, f"{arch}.rope.freq_base", 10000.0)))
    head_dim = field(model, f"{arch}.attention.key_length", None)
    return text if head_dim is None else dict(text, head_dim=int(head_dim))


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
    from transformers import AutoConfig, GenerationConfig

    from atlas_vlm.tokenizer import save_gguf_tokenizer

    pair = PAIRS[model_type]
    tokenizer, settings = _tokenizer(model_path)
    arch = field(model, "general.architecture")
    names = {t.name for t in model.tensors}
    n_vocab = int(next(t for t in model.tensors if t.name == "token_embd.weight").shape[-1])
    ids = settings.token_ids
    eos = [ids[k] for k in ("eos", "eot") if k in ids]
    eos = sorted(set(eos), key=eos.index)
    text = dict(pair.text_config(model, arch, _text_config(model, arch, n_vocab)), bos_token_id=ids.get("bos"),
                eos_token_id=eos[0] if eos else None)
    tokens = {key: _token_id(tokenizer, tok, model_path) for key, tok in pair.special_tokens.items()}
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=pair.vision_config(mm),
        tie_word_embeddings="output.weight" not in names,
        architectures=[get_family(model_type).architectures[0]], **pair.top_config(mm), **tokens)
    config.save_pretrained(tmp)
    GenerationConfig(bos_token_id=ids.get("bos"), pad_token_id=ids.get("pad"),
                     eos_token_id=eos if len(eos) > 1 else (eos[0] if eos else None)).save_pretrained(tmp)
    pair.save_processor(tmp, mm, config, tokenizer, get_family(model_type).family_hooks().processor_defaults)
    save_gguf_tokenizer(tokenizer, settings, tmp)  # after the processor, which saves its tokenizer too
    visual = {f"visual.{k}": v.contiguous() for k, v in pair.vision_state_dict(mm, model_type, mmproj_path).items()}
    save_file(visual, str(tmp / "vision.safetensors"))
    if dense:
        weights = {k: v.to(torch.float32).contiguous() for k, v in text_state_dict(model).items()}
        save_file(weights, str(tmp / "model.safetensors"))


def gguf_pair_folder(model_path: Path, mmproj_path: Path, *, dense: bool) -> Path:
    """A cached HF folder for the VLM GGUF pair ``model_path`` + ``mmproj_path`` (built once).

    Args:
        model_path: the language model GGUF (llama.cpp's ``qwen2vl`` / ``qwen3vl`` / ``llama`` architecture).
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
    from atlas_vlm.checkpoint import ModelNotFoundError, build_folder_once, cache_dir, read_gguf

    for what, path in (("model", model_path), ("mmproj", mmproj_path)):
        if not path.is_file():
            raise ModelNotFoundError(f"{what} file {path} does not exist")
    model, mm = read_gguf(model_path), read_gguf(mmproj_path)
    model_type = check_pair(model, mm, model_path, mmproj_path)
    ident = ":".join([GGUF_PAIR_VERSION, str(dense)] + [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                                         for p in (model_path, mmproj_path)])
    out = cache_dir() / "gguf-pair" / f"{model_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return out
    return build_folder_once(out, lambda tmp: _save(tmp, model_path, mmproj_path, model, mm, model_type, dense))


