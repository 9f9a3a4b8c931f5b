"""Atomic file writes whose temporaries a killed writer does not leave behind.

A file is written under a temporary name in its target's folder, fsynced and renamed over the
target (``os.replace``), so a reader sees the whole file or none. The writer holds an exclusive
``flock`` on the temporary from just after creating it until the rename: the kernel drops the
lock when the process dies, SIGKILL included, so ``remove_dead_temporaries`` (run when a tier
opens a folder) tells a dead writer's temporary (lock free: deleted at once) from one a live
process is writing (locked: kept), across processes sharing the folder. Where ``fcntl`` is
missing (not POSIX) a temporary is taken for dead once ``stale_s`` old, as before locks.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["remove_dead_temporaries", "write_atomic"]


def write_atomic(target: Path, data: bytes, prefix: str) -> bool:
    """Write ``data`` to ``target`` atomically through a locked temporary
    ``<prefix>*<target suffix>.part`` in ``target``'s folder.

    Returns:
        True once written; False when the temporary vanished before the rename (another
        process opening the folder took it for a dead writer's): nothing is written then.

    Raises:
        OSError: creating, writing, syncing or renaming failed (the temporary is removed).
    """
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=target.suffix + ".part")
    try:
        with os.fdopen(fd, "wb") as f:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # held until closed, after the rename
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            try:
                os.replace(tmp, target)
            except FileNotFoundError:
                return False
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


def remove_dead_temporaries(folders: Iterable[Path], prefix: str, stale_s: float) -> int:
    """Delete the temporaries (``<prefix>*``) in ``folders`` whose writer is gone: no process
    holds their lock (a writer killed mid-write), or, where locks cannot be taken, older than
    ``stale_s`` seconds. Returns how many were deleted; never raises ``OSError``."""
    removed = 0
    for folder in folders:
        for path in folder.glob(prefix + "*") if folder.is_dir() else ():
            if _writer_is_gone(path, stale_s):
                try:
                    path.unlink()
                    removed += 1
                except OSError:
                    continue
    return removed


def _writer_is_gone(path: Path, stale_s: float) -> bool:
    if fcntl is not None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:  # deleted meanwhile (renamed into place), or not ours to open
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True  # nobody writes it (a live writer holds the lock until its rename)
        except BlockingIOError:
            return False
        except OSError:  # a file system without locks: the age rule
            pass
        finally:
            os.close(fd)
    try:
        return path.stat().st_mtime < time.time() - stale_s
    except OSError:
        return False
