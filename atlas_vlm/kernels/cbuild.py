"""Building and loading the engine's small C kernels (``kernels/csrc/*.c``): compiled on first
use with the system C compiler (``$CC``, else ``cc`` / ``gcc``) for the CPU the process runs
on, cached by a hash of source and flags under ``$ATLAS_VLM_CACHE/kernels/`` (default
``~/.cache/atlas_vlm``), and loaded with ``ctypes`` after torch, so they share torch's OpenMP
runtime (``libgomp``). Used by ``decode_kernel`` and ``quant_kernel``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

from atlas_vlm import hardware

BASE_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# (extra options, link flags) to try in turn: glibc's vector expf (libmvec) first, plain libm if it is missing
LIBMVEC_ATTEMPTS = [(["-DATLAS_LIBMVEC"], ["-lmvec", "-lm"]), ([], ["-lm"])]


def cpu_flags(*extra: str, cpu: hardware.CpuFeatures | None = None) -> list[str]:
    """``BASE_FLAGS``, then ``extra``, then ``-march`` for ``cpu`` (default this machine's
    ``hardware.cpu_features()``): ``kernel_march``, none where it is None (any CPU)."""
    march = (cpu or hardware.cpu_features()).kernel_march
    return [*BASE_FLAGS, *extra] + ([f"-march={march}"] if march is not None else [])


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on the PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    """Where built kernels live: ``$ATLAS_VLM_CACHE/kernels`` (default ``~/.cache/atlas_vlm``)."""
    return Path(os.environ.get("ATLAS_VLM_CACHE", Path.home() / ".cache" / "atlas_vlm")) / "kernels"


def build(source: Path, cc: str, opts: list[str], libs: list[str]) -> Path:
    """The shared library of ``source`` for compiler options ``opts`` and link flags ``libs``,
    compiled unless already in the cache (named ``<stem>-<hash>.so``, the hash of every file in
    the source's folder (a source may include the others), the compiler and the flags).

    Raises:
        subprocess.SubprocessError: the compiler failed; OSError: the cache is not writable.
    """
    sources = b"".join(p.read_bytes() for p in sorted(source.parent.iterdir()) if p.suffix in (".c", ".h"))
    key = hashlib.sha1(source.read_bytes() + sources + " ".join([cc, *opts, *libs]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([cc, *opts, "-o", str(built), str(source), *libs], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(built, target)  # atomic: concurrent builders each rename a whole file
    return target


def load(source: Path, opts: list[str], attempts: list[tuple[list[str], list[str]]], what: str) -> ctypes.CDLL | None:
    """Build and load ``source`` with ``opts``, trying each ``(extra options, link flags)`` of
    ``attempts`` in turn; None (the reason logged once, naming ``what`` falls back) when there
    is no compiler or every attempt fails."""
    cc = compiler()
    if cc is None:
        log.info("no C compiler found ($CC, cc, gcc): %s", what)
        return None
    errors = []
    for extra, libs in attempts:
        try:
            return ctypes.CDLL(str(build(source, cc, [*opts, *extra], libs)))
        except (OSError, subprocess.SubprocessError) as e:
            errors.append((getattr(e, "stderr", "") or str(e)).strip()[:300])
    log.warning("building %s failed: %s; %s", source.name, " | ".join(errors), what)
    return None
