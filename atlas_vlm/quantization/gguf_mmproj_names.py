"""Shared pieces of the VLM GGUF pairs: header values, tensor decoding, the checks a pair passes
before any conversion, and the decoder's GGUF names mapped back to HF's.

Source of the names: llama.cpp's ``gguf-py/gguf/constants.py`` ``TENSOR_NAMES``
(``blk.N.attn_q`` ...); the ``llama`` architecture's Q/K rows are permuted by the converter
(``LlamaModel.permute``), undone here as transformers' ``_reverse_permute_weights`` does. The
towers' names live with their projectors (``gguf_mmproj_qwen``, ``gguf_mmproj_idefics3``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

__all__ = ["PROJECTORS", "LM_ARCHITECTURES", "field", "f32", "dequantized", "check_pair", "TensorTaker",
           "text_state_dict"]

#: ``clip.projector_type`` -> the HF ``model_type`` it belongs to (the families we run)
PROJECTORS = {"qwen2vl_merger": "qwen2_vl", "qwen2.5vl_merger": "qwen2_5_vl", "qwen3vl_merger": "qwen3_vl",
              "idefics3": "smolvlm"}
#: the model GGUF's ``general.architecture`` each family's decoder is written as
LM_ARCHITECTURES = {"qwen2_vl": "qwen2vl", "qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "smolvlm": "llama"}
_NAMES = "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM2"

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


def f32(x) -> float:
    """A header float32 as the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(x)))


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
                         f"{', '.join(sorted(PROJECTORS))} ({_NAMES})")
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


class TensorTaker:
    """Takes an mmproj's tensors by name (dequantized, fp32, HF shape) and remembers which it took.

    Raises (on call): ValueError naming the file, the family and the missing tensor.
    """

    def __init__(self, mm, model_type: str, mmproj_path: Path):
        self.tensors = {x.name: x for x in mm.tensors}
        self.model_type, self.path, self.used = model_type, mmproj_path, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"mmproj file {self.path} lacks tensor {name} of a {self.model_type} tower")
        self.used.add(name)
        return dequantized(self.tensors[name])

    def check_all_used(self) -> None:
        """Raises ValueError naming (up to 8) tensors the family's tower does not use."""
        left = sorted(set(self.tensors) - self.used)
        if left:
            raise ValueError(f"mmproj file {self.path} has tensors {left[:8]} that a {self.model_type} tower does not use")


_TEXT = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TEXT_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def text_state_dict(model) -> dict[str, torch.Tensor]:
    """The model GGUF's decoder as HF tensors (``model.layers.N...``), dequantized to fp32; the
    ``llama`` architecture's Q/K rows back in HF's order. Names we do not map (``rope_freqs``
    ...) are left out; the loader reports what is missing."""
    from atlas_vlm.quantization.gguf import _row_permutation  # llama.cpp's Q/K permutation undone

    arch = field(model, "general.architecture")
    heads = {"attn_q": int(field(model, f"{arch}.attention.head_count", 0)),
             "attn_k": int(field(model, f"{arch}.attention.head_count_kv", 0))}
    out = {}
    for t in model.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m and m.group(2) in _TEXT:
            w = dequantized(t)
            if arch == "llama" and m.group(2) in heads:
                w = w[_row_permutation(w.shape[0], heads[m.group(2)])]
            out[f"model.layers.{m.group(1)}.{_TEXT[m.group(2)]}.{m.group(3)}"] = w
        elif t.name.rsplit(".", 1)[0] in _TEXT_TOP:
            base, kind = t.name.rsplit(".", 1)
            out[f"{_TEXT_TOP[base]}.{kind}"] = dequantized(t)
    return out
