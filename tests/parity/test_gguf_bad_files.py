"""Bad GGUF files are refused at load in one line naming the file, the tensor and what is wrong,
before anything is converted or written to the cache: a file cut inside a tensor's data, a file
cut inside its header, not a GGUF at all, a tensor whose byte count overlaps the next tensor's
data (its type and shape do not match the layout), a tensor type id the format does not know."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from atlas_vlm import LLM
from atlas_vlm.checkpoint import GGUFFileError, read_gguf

pytestmark = pytest.mark.text


def _write(path, rows: int = 8, k: int = 64) -> None:
    """A two-tensor GGUF (a Q8_0 ``blk.0.attn_q.weight``, then an F32 norm), no model around them."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", quantize(rng.standard_normal((rows, k)).astype(np.float32),
                                                 GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(k, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _part_start(path, tensor: str, part: int) -> int:
    """Byte position in the file where part ``part`` of ``tensor``'s info field starts (the
    parts: name length, name, dims count, dims, type id (4), data offset (5))."""
    field = next(t.field for t in GGUFReader(str(path)).tensors if t.name == tensor)
    return field.offset + sum(int(p.nbytes) for p in field.parts[:part])


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.gguf"
    _write(path)
    return path


def test_good_file_reads_as_the_reader_does(good):
    ours, theirs = read_gguf(good), GGUFReader(str(good))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_truncated_data_names_tensor(good, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = good.read_bytes()
    cut.write_bytes(data[:len(data) - 100])  # inside the last tensor (the F32 norm: 256 bytes)
    with pytest.raises(GGUFFileError) as e:
        read_gguf(cut)
    msg = str(e.value)
    assert "\n" not in msg and str(cut) in msg and "'blk.0.attn_norm.weight'" in msg and "truncated" in msg


def test_truncated_header_and_not_gguf(good, tmp_path):
    cut = tmp_path / "head.gguf"
    cut.write_bytes(good.read_bytes()[:40])
    with pytest.raises(GGUFFileError, match=r"head\.gguf: not a readable GGUF file \(truncated or corrupt header"):
        read_gguf(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFFileError, match=r"junk\.gguf: not a readable GGUF file .*magic"):
        read_gguf(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFileError, match=r"empty\.gguf: not a readable GGUF file"):
        read_gguf(empty)


def test_overlapping_tensor_bytes_named(good):
    """The norm's data offset moved back into the Q8_0 tensor: the Q8_0's bytes (8 rows x 2
    blocks x 34) no longer fit before the next tensor's data."""
    pos = _part_start(good, "blk.0.attn_norm.weight", 5)
    with open(good, "r+b") as f:
        f.seek(pos)
        f.write(np.uint64(64).tobytes())
    with pytest.raises(GGUFFileError) as e:
        read_gguf(good)
    msg = str(e.value)
    assert "'blk.0.attn_q.weight' (Q8_0" in msg and "'blk.0.attn_norm.weight' begins inside them" in msg


def test_unknown_type_named(good):
    pos = _part_start(good, "blk.0.attn_q.weight", 4)
    with open(good, "r+b") as f:
        f.seek(pos)
        f.write(np.uint32(250).tobytes())
    with pytest.raises(GGUFFileError, match=r"tensor 'blk.0.attn_q.weight' has unknown GGML type id 250"):
        read_gguf(good)


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_load_refuses_before_writing_anything(tmp_path, monkeypatch, quantization):
    """Through ``LLM``: the one-line error, and the cache folder left empty (no half-written
    conversion, no metadata folder)."""
    from atlas_vlm.default_models import default_text_model

    cache = tmp_path / "cache"
    monkeypatch.setenv("ATLAS_VLM_CACHE", str(cache))
    cut = tmp_path / "model.gguf"
    with open(default_text_model(), "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(default_text_model()) // 2))
    with pytest.raises(GGUFFileError, match=r"model\.gguf: tensor '.*' \(.*\) needs bytes .* the file is truncated"):
        LLM(str(cut), quantization=quantization)
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))
