"""What the loader, the Hub resolver and the quantized loaders share: the checkpoint cache,
its errors, the loaded-model record and the HF -> our tensor naming.

This module sits below ``atlas_vlm.loader``, ``atlas_vlm.hub`` and ``atlas_vlm.quantization``:
they all import it, it imports none of them (so no import circle runs through the loader;
``tests/test_import_graph.py`` checks that). ``atlas_vlm.loader`` re-exports every public
name here, so ``from atlas_vlm.loader import ModelNotFoundError`` keeps working.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GGUFFileError", "LoadedModel", "ModelNotFoundError", "build_folder_once", "cache_dir", "copy_dense",
           "our_name", "read_gguf"]

_STACKED = {  # HF name part -> (our fused name part, shard index)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or holds no loadable checkpoint."""


class GGUFFileError(ValueError):
    """A ``.gguf`` file that cannot be read as GGUF: truncated, corrupt, or a tensor whose bytes
    do not match its type and shape. The message is one line naming the file (and the tensor)."""


class _Bytes(bytes):
    """A GGUF string's bytes where ``gguf.ReaderField`` keeps a numpy view (``tobytes``, ``nbytes``)."""

    __slots__ = ()

    def tobytes(self) -> bytes:
        return bytes(self)

    @property
    def nbytes(self) -> int:
        return len(self)


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _FastFields:
    """``GGUFReader._build_fields`` in a Python walk over the header's bytes: the reader's own
    makes two memmap views per string (13-18 s for a 151,936-token vocabulary and its merges on
    this project's machine; this: 0.6 s). The fields are ``gguf.ReaderField`` as the reader
    makes them (``contents()``, ``parts[data[i]]``), strings as bytes with ``tobytes``."""

    def _build_fields(self, offs: int, count: int) -> int:
        import numpy as np
        from gguf.constants import GGUFValueType
        from gguf.gguf_reader import ReaderField

        mv = memoryview(self.data)
        for _ in range(count):
            orig = offs
            (klen,) = struct.unpack_from("<Q", mv, offs)
            key = bytes(mv[offs + 8:offs + 8 + klen]).decode("utf-8")
            offs += 8 + klen
            (vtype,) = struct.unpack_from("<I", mv, offs)
            offs += 4
            parts = [np.array([klen], np.uint64), np.frombuffer(key.encode(), np.uint8), np.array([vtype], np.uint32)]
            types = [GGUFValueType(vtype)]
            if vtype == 8:  # string
                (n,) = struct.unpack_from("<Q", mv, offs)
                parts += [np.array([n], np.uint64), _Bytes(mv[offs + 8:offs + 8 + n])]
                data, offs = [4], offs + 8 + n
            elif vtype == 9:  # array
                itype, n = struct.unpack_from("<IQ", mv, offs)
                offs += 12
                types.append(GGUFValueType(itype))
                parts += [np.array([itype], np.uint32), np.array([n], np.uint64)]
                base = len(parts)
                if itype == 8:
                    for _i in range(n):
                        (length,) = struct.unpack_from("<Q", mv, offs)
                        parts += [np.uint64(length), _Bytes(mv[offs + 8:offs + 8 + length])]
                        offs += 8 + length
                    data = list(range(base + 1, base + 2 * n, 2))
                elif itype in _SCALARS:
                    dt = np.dtype("<" + _SCALARS[itype])
                    arr = np.frombuffer(bytes(mv[offs:offs + dt.itemsize * n]), dt)
                    offs += dt.itemsize * n
                    parts += [arr[i:i + 1] for i in range(n)]
                    data = list(range(base, base + n))
                else:
                    raise ValueError(f"metadata key {key!r} is an array of GGUF value type {itype} (nested arrays "
                                     f"are not read)")
            elif vtype in _SCALARS:
                dt = np.dtype("<" + _SCALARS[vtype])
                parts.append(np.frombuffer(bytes(mv[offs:offs + dt.itemsize]), dt))
                data, offs = [3], offs + dt.itemsize
            else:
                raise ValueError(f"metadata key {key!r} has unknown GGUF value type {vtype}")
            self._push_field(ReaderField(orig, key, parts, data, types), skip_sum=True)
        return offs


def read_gguf(path):
    """``gguf.GGUFReader`` over ``path`` (memory-mapped, nothing copied), checked first: every
    tensor's type is known, its row a whole number of its type's blocks, its bytes
    (``elements / block_size * type_size``, ``gguf.GGML_QUANT_SIZES``) inside the file and
    before the next tensor's data. The header's fields are parsed by ``_FastFields`` (the
    reader's own parse takes seconds on a large vocabulary). The reader alone fails on a truncated file with numpy's
    "When changing to a larger dtype, its size must be a divisor ...".

    Raises:
        GGUFFileError: one line naming the file, the tensor and what is wrong (a truncated or
            corrupt header names the file and what the reader saw).
    """
    import gguf

    path = Path(path)

    class Checked(_FastFields, gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            spans = []
            for field in fields:
                _len, name_data, _n_dims, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise GGUFFileError(f"{path}: tensor {name!r} has unknown GGML type id {int(raw_type[0])}") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                shape = [int(d) for d in dims]
                if shape and shape[0] % block:
                    raise GGUFFileError(f"{path}: tensor {name!r} ({qtype.name}, shape {shape}) has rows of "
                                        f"{shape[0]} elements, not a whole number of {block}-element blocks")
                begin = int(start_offs) + int(offset[0])
                end = begin + math.prod(shape) // block * type_size
                if end > len(self.data):
                    raise GGUFFileError(f"{path}: tensor {name!r} ({qtype.name}, shape {shape}) needs bytes "
                                        f"{begin}..{end} but the file has {len(self.data)}: the file is truncated")
                spans.append((begin, end, name, qtype.name, shape))
            spans.sort()
            for (_, end, name, kind, shape), (nxt, _, other, _, _) in zip(spans, spans[1:]):
                if end > nxt:
                    raise GGUFFileError(f"{path}: tensor {name!r} ({kind}, shape {shape}) needs {end - spans[0][0]} "
                                        f"bytes past the data start but tensor {other!r} begins inside them: its byte "
                                        f"count does not match its type and shape")
            super()._build_tensors(start_offs, fields)

    try:
        return Checked(str(path))
    except GGUFFileError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, OSError,
            struct.error) as e:
        if isinstance(e, FileNotFoundError):
            raise ModelNotFoundError(f"GGUF file {path} does not exist") from None
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GGUFFileError(f"{path}: not a readable GGUF file (truncated or corrupt header: {msg})") from None


@dataclass
class LoadedModel:
    model: object  # our decoder (atlas_vlm.models.CausalLM), weights loaded, in eval mode
    hf_config: object  # the transformers config
    tokenizer: object  # the transformers tokenizer
    vision_state_dict: dict[str, torch.Tensor] | None  # "visual.*" weights without the prefix
    model_dir: Path  # the folder actually loaded (the GGUF cache folder for a .gguf)
    image_settings: object = None  # mm_token_pipeline.ImageProcessorSettings of a VLM, else None


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$ATLAS_VLM_CACHE`` or ``~/.cache/atlas_vlm``."""
    return Path(os.environ.get("ATLAS_VLM_CACHE", Path.home() / ".cache" / "atlas_vlm"))


def build_folder_once(out: Path, build: Callable[[Path], None]) -> Path:
    """Fill the cache folder ``out`` with ``build(tmp)`` in a temporary sibling (one per
    process), then rename it into place, so a half-written folder is never used; when a
    concurrent build wins the race, its folder is kept. Returns ``out``.

    Raises:
        OSError: the rename failed and no finished ``out`` exists.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():  # not a concurrent build that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def our_name(hf_name: str) -> tuple[str | None, str, int | None]:
    """HF tensor name -> ("text" | "visual" | None, our name, shard index or None).

    ``q/k/v_proj`` become shards 0-2 of ``qkv_proj``, ``gate/up_proj`` shards 0-1 of
    ``gate_up_proj``; ``visual.*`` / SmolVLM's ``vision_model.*`` and ``connector.*`` go to
    the vision tower; ``rotary_emb.inv_freq`` buffers are ignored (None).
    """
    name = re.sub(r"^model\.(language_model|text_model)\.", "model.", hf_name)  # text_model: SmolVLM
    if name.startswith(("model.vision_model.", "model.connector.")):  # SmolVLM tower + connector
        return "visual", name[len("model."):], None
    if name.startswith(("visual.", "model.visual.")):
        return "visual", name.split("visual.", 1)[1], None
    if _IGNORED.search(name):
        return None, name, None
    for part, (fused, shard) in _STACKED.items():
        if f".{part}." in name:
            return "text", name.replace(f".{part}.", f".{fused}."), shard
    return "text", name, None


def copy_dense(target: torch.Tensor, name: str, shard: int | None, tensor: torch.Tensor, hf_name: str, arch,
               qkv_sizes: list[int]) -> str:
    """Copy one HF tensor into our parameter ``target`` (its rows ``shard`` of a fused
    qkv / gate_up projection when ``shard`` is not None). Returns the loaded name
    (``name#shard`` for a shard).

    Raises:
        ValueError: the shapes differ (both named).
    """
    if shard is not None:
        sizes = qkv_sizes if "qkv_proj" in name else [arch.intermediate_size] * 2
        target = target.narrow(0, sum(sizes[:shard]), sizes[shard])  # [rows of this shard, in]
        name = f"{name}#{shard}"
    if target.shape != tensor.shape:
        raise ValueError(f"weight {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)
    return name
