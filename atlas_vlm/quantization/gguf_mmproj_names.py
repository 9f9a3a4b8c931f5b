"""llama.cpp's GGUF tensor names of a VLM pair mapped back to the HF names our loader and
vision towers read, and the checks a pair passes before any conversion.

Source of the names: llama.cpp's ``gguf-py/gguf/tensor_mapping.py`` (``V_*``, ``V_MMPROJ``,
``V_POST_NORM``) and ``conversion/qwenvl.py`` (q/k/v split from HF's fused ``qkv``; the
Conv3D ``patch_embed`` split into its temporal halves ``v.patch_embd.weight`` /
``v.patch_embd.weight.1``); decoder names from ``TENSOR_NAMES`` (``blk.N.attn_q`` ...).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

__all__ = ["PROJECTORS", "LM_ARCHITECTURES", "GATED_TOWER", "field", "dequantized", "check_pair", "vision_state_dict",
           "text_state_dict"]

#: ``clip.projector_type`` -> the HF ``model_type`` it belongs to (the families we run)
PROJECTORS = {"qwen2vl_merger": "qwen2_vl", "qwen2.5vl_merger": "qwen2_5_vl"}
#: the model GGUF's ``general.architecture`` each family's decoder is written as
LM_ARCHITECTURES = {"qwen2_vl": "qwen2vl", "qwen2_5_vl": "qwen2vl"}
#: the tower's layout per family: gated MLP and RMSNorms (Qwen2.5-VL) or fc1/fc2 of
#: ``mlp_ratio`` and LayerNorms with bias (Qwen2-VL)
GATED_TOWER = {"qwen2_vl": False, "qwen2_5_vl": True}

_MISSING = object()


def field(reader, key: str, default=_MISSING):
    """A GGUF header value (``str`` / number / list) of ``reader`` (``gguf.GGUFReader``).

    Raises:
        ValueError: ``key`` is absent and no ``default`` is given (names the key).
    """
    if key not in reader.fields:
        if default is _MISSING:
            raise ValueError(f"GGUF header lacks {key}")
        return default
    return reader.fields[key].contents()


def dequantized(t) -> torch.Tensor:
    """A GGUF tensor of any type the ``gguf`` package decodes, as fp32 in HF's shape (GGUF
    lists dims innermost first)."""
    from gguf import GGMLQuantizationType, quants

    arr = np.asarray(t.data)
    if t.tensor_type != GGMLQuantizationType.F32:
        arr = quants.dequantize(arr, t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(tuple(int(x) for x in reversed(t.shape)))


def check_pair(model, mm, model_path: Path, mmproj_path: Path) -> str:
    """Check a (model, mmproj) pair of ``GGUFReader``s; return the HF ``model_type``.

    Raises:
        ValueError: ``mmproj_path`` is not an mmproj file (``general.architecture`` is not
            ``clip`` or it has no vision encoder), ``model_path`` is one, the projector type is
            not one we run (``PROJECTORS``), the decoder's architecture is not that family's,
            or the projection width differs from the decoder's hidden size (an mmproj of
            another model). Each message names the file and the values.
    """
    mm_arch, lm_arch = field(mm, "general.architecture", None), field(model, "general.architecture", None)
    if lm_arch == "clip":
        raise ValueError(f"model GGUF {model_path} is an mmproj file (general.architecture 'clip'); pass the "
                         f"language model GGUF as the model and this file as mmproj")
    if mm_arch != "clip" or not field(mm, "clip.has_vision_encoder", False):
        raise ValueError(f"mmproj file {mmproj_path} is not an mmproj GGUF with a vision encoder "
                         f"(general.architecture {mm_arch!r}; llama.cpp writes 'clip' with clip.has_vision_encoder)")
    projector = field(mm, "clip.projector_type", None)
    if projector not in PROJECTORS:
        raise ValueError(f"mmproj file {mmproj_path} has projector type {projector!r}; supported: "
                         f"{', '.join(sorted(PROJECTORS))} (Qwen2-VL, Qwen2.5-VL)")
    model_type = PROJECTORS[projector]
    if lm_arch != LM_ARCHITECTURES[model_type]:
        raise ValueError(f"model GGUF {model_path} has architecture {lm_arch!r}, but mmproj {mmproj_path} is a "
                         f"{model_type} tower, whose language model llama.cpp writes as "
                         f"{LM_ARCHITECTURES[model_type]!r}")
    width, hidden = int(field(mm, "clip.vision.projection_dim")), int(field(model, f"{lm_arch}.embedding_length"))
    if width != hidden:
        raise ValueError(f"mmproj file {mmproj_path} projects to width {width}, but model GGUF {model_path} has "
                         f"hidden size {hidden}: the mmproj belongs to another model")
    return model_type


_BLOCK = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2"}
_MLP = {True: {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},  # by GATED_TOWER
        False: {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}}
_TOP = {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"}


def vision_state_dict(mm, model_type: str, mmproj_path: Path) -> dict[str, torch.Tensor]:
    """The mmproj's tower as HF ``visual.*`` tensors without the prefix (fp32).

    Raises:
        ValueError: a tensor is missing, or one is left that the family does not use (named).
    """
    t = {x.name: x for x in mm.tensors}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in t:
            raise ValueError(f"mmproj file {mmproj_path} lacks tensor {name} of a {model_type} tower")
        used.add(name)
        return dequantized(t[name])

    halves = [take("v.patch_embd.weight"), take("v.patch_embd.weight.1")]  # [out, in, h, w] each
    out["patch_embed.proj.weight"] = torch.stack(halves, dim=2)  # HF Conv3D [out, in, t=2, h, w]
    depth = int(field(mm, "clip.vision.block_count"))
    parts = {**_BLOCK, **_MLP[GATED_TOWER[model_type]]}
    rms = GATED_TOWER[model_type]  # Qwen2.5-VL's norms are RMSNorms: weight only
    for i in range(depth):
        for kind in ("weight", "bias"):
            out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([take(f"v.blk.{i}.attn_{p}.{kind}") for p in "qkv"])
        for ours, hf in parts.items():
            for kind in ("weight",) if rms and ours.startswith("ln") else ("weight", "bias"):
                out[f"blocks.{i}.{hf}.{kind}"] = take(f"v.blk.{i}.{ours}.{kind}")
    for ours, hf in _TOP.items():
        for kind in ("weight",) if rms and ours == "v.post_ln" else ("weight", "bias"):
            out[f"{hf}.{kind}"] = take(f"{ours}.{kind}")
    left = sorted(set(t) - used)
    if left:
        raise ValueError(f"mmproj file {mmproj_path} has tensors {left[:8]} that a {model_type} tower does not use")
    return out


_TEXT = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TEXT_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def text_state_dict(model) -> dict[str, torch.Tensor]:
    """The model GGUF's decoder as HF tensors (``model.layers.N...``), dequantized to fp32.
    Names we do not map (``rope_freqs`` ...) are left out; the loader reports what is missing."""
    out = {}
    for t in model.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m and m.group(2) in _TEXT:
            out[f"model.layers.{m.group(1)}.{_TEXT[m.group(2)]}.{m.group(3)}"] = dequantized(t)
        elif t.name.rsplit(".", 1)[0] in _TEXT_TOP:
            base, kind = t.name.rsplit(".", 1)
            out[f"{_TEXT_TOP[base]}.{kind}"] = dequantized(t)
    return out
