"""The real bench file's assembly (``benchmarks.real_file``), on small fake parts: the parts
are concatenated in order, the size and sha256 are checked, a mismatch or a missing part leaves
neither the target nor a ``.part`` file, a correct file is recognised (and a changed one is not),
and ``ensure`` skips the download when the file is already there. No package is installed."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ sits beside tests/
from benchmarks import real_file  # noqa: E402

pytestmark = pytest.mark.text


def fake_parts(tmp_path: Path) -> tuple[list[Path], bytes]:
    chunks = [bytes([n]) * (1000 + 37 * n) for n in range(1, 6)]  # distinct bytes: order matters
    paths = []
    for n, chunk in enumerate(chunks, 1):
        p = tmp_path / "parts" / f"part{n:02d}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(chunk)
        paths.append(p)
    return paths, b"".join(chunks)


def test_assemble_concatenates_in_order_and_stamps(tmp_path, monkeypatch):
    parts, whole = fake_parts(tmp_path)
    target = tmp_path / "out" / "m.gguf"
    sha = hashlib.sha256(whole).hexdigest()
    monkeypatch.setattr(real_file, "CHUNK", 256)  # several reads per part
    assert real_file.assemble(parts, target, len(whole), sha) == target
    assert target.read_bytes() == whole
    assert not (tmp_path / "out" / "m.gguf.part").exists()
    assert real_file.is_correct(target, len(whole), sha)
    monkeypatch.setattr(real_file, "_sha256", lambda p: pytest.fail("stamp not used"))
    assert real_file.is_correct(target, len(whole), sha)  # from the stamp, no hashing


@pytest.mark.parametrize("wrong", ["sha", "order", "short", "long"])
def test_assemble_refuses_a_mismatch_and_leaves_nothing(tmp_path, wrong):
    parts, whole = fake_parts(tmp_path)
    size, sha = len(whole), hashlib.sha256(whole).hexdigest()
    if wrong == "sha":
        sha = "0" * 64
    elif wrong == "order":
        parts = parts[::-1]  # same size, other bytes
    elif wrong == "short":
        parts = parts[:-1]
    else:
        size -= 1
    target = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="m.gguf: .*(sha256|bytes).*not written"):
        real_file.assemble(parts, target, size, sha)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parts"]  # no target, no .part


def test_assemble_refuses_a_missing_part_and_keeps_an_old_target(tmp_path):
    parts, whole = fake_parts(tmp_path)
    target = tmp_path / "m.gguf"
    target.write_bytes(b"old")
    with pytest.raises(FileNotFoundError, match="part .*part09.bin does not exist"):
        real_file.assemble(parts + [tmp_path / "parts" / "part09.bin"], target, len(whole),
                           hashlib.sha256(whole).hexdigest())
    assert target.read_bytes() == b"old"
    assert not (tmp_path / "m.gguf.part").exists()


def test_is_correct_rejects_a_changed_file(tmp_path):
    parts, whole = fake_parts(tmp_path)
    target, sha = tmp_path / "m.gguf", hashlib.sha256(whole).hexdigest()
    real_file.assemble(parts, target, len(whole), sha)
    target.write_bytes(whole[:-1] + b"\xff")  # same size, new mtime: the stamp no longer applies
    assert not real_file.is_correct(target, len(whole), sha)
    assert not real_file.is_correct(tmp_path / "absent.gguf", len(whole), sha)


def test_ensure_skips_a_correct_file_and_assembles_a_missing_one(tmp_path, monkeypatch):
    parts, whole = fake_parts(tmp_path)
    monkeypatch.setattr(real_file, "SIZE", len(whole))
    monkeypatch.setattr(real_file, "SHA256", hashlib.sha256(whole).hexdigest())
    asked = []
    monkeypatch.setattr(real_file, "installed_parts", lambda scratch: asked.append(scratch) or iter(parts))
    target = tmp_path / "cache" / "m.gguf"
    real_file.ensure(target, log=lambda m: None)
    assert target.read_bytes() == whole and len(asked) == 1
    assert not asked[0].exists()  # the scratch folder is gone
    real_file.ensure(target, log=lambda m: None)
    assert len(asked) == 1  # already there and correct: nothing installed
