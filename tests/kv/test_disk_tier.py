"""DiskKVTier (mm_kv_cache_management/disk_tier.py): exact round trips, corrupt / truncated /
foreign files are misses (deleted, logged once), the LRU size cap, an unwritable folder or a
full disk degrades with one warning, and two processes sharing a folder never read a partial
block."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from mm_kv_cache_management import DiskKVTier
from mm_kv_cache_management.disk_tier import SUFFIX

pytestmark = pytest.mark.text

SHAPE = (2, 4, 2, 8)  # [num_layers, block_size, num_kv_heads, head_dim]
FP = "a" * 32


def kv(seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact_and_a_block_is_written_once(tmp_path, dtype):
    tier = DiskKVTier(tmp_path, FP, 1 << 20)
    k, v = kv(0, dtype)
    assert tier.save(h(1), k, v) is True
    assert tier.save(h(1), *kv(1, dtype)) is False  # already on disk: not rewritten
    got = tier.load(h(1), SHAPE, dtype)
    assert got is not None and torch.equal(got[0], k) and torch.equal(got[1], v)
    assert got[0].dtype == dtype and tuple(got[0].shape) == SHAPE
    assert tier.load(h(2), SHAPE, dtype) is None
    assert (tier.hits, tier.misses) == (1, 1)
    assert tier.path(h(1)).parent == tmp_path / FP and tier.path(h(1)).name == h(1).hex() + SUFFIX
    assert tier.bytes_stored == tier.path(h(1)).stat().st_size
    assert not [p for p in (tmp_path / FP).iterdir() if p.suffix != SUFFIX]  # no temporary file left


def _flip_payload_byte(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def _garbage(path):
    path.write_bytes(b"not a block")


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate, _garbage])
def test_damaged_file_is_a_miss_deleted_and_logged_once(tmp_path, caplog, damage):
    tier = DiskKVTier(tmp_path, FP, 1 << 20)
    for i in (1, 2):
        tier.save(h(i), *kv(i))
        damage(tier.path(h(i)))
    with caplog.at_level(logging.WARNING, logger="mm_kv_cache_management.disk_tier"):
        assert tier.load(h(1), SHAPE, torch.float32) is None
        assert tier.load(h(2), SHAPE, torch.float32) is None
    assert not tier.path(h(1)).exists() and not tier.path(h(2)).exists()
    assert tier.misses == 2 and tier.hits == 0
    assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 1
    tier.save(h(1), *kv(1))  # written again after the delete
    assert torch.equal(tier.load(h(1), SHAPE, torch.float32)[0], kv(1)[0])


def test_file_of_another_fingerprint_shape_or_dtype_is_a_miss(tmp_path):
    other = DiskKVTier(tmp_path, "b" * 32, 1 << 20)
    other.save(h(1), *kv(1))
    tier = DiskKVTier(tmp_path, FP, 1 << 20)
    shutil.copy(other.path(h(1)), tier.path(h(1)))  # same name, other engine's K/V
    assert tier.load(h(1), SHAPE, torch.float32) is None and not tier.path(h(1)).exists()
    tier.save(h(2), *kv(2))
    assert tier.load(h(2), (2, 4, 2, 4, 2), torch.float32) is None  # same bytes, other shape
    tier.save(h(3), *kv(3))
    assert tier.load(h(3), SHAPE, torch.int32) is None
    assert other.load(h(1), SHAPE, torch.float32) is not None  # the other folder is untouched
    shutil.copy(other.path(h(1)), tier.path(h(4)))  # right fingerprint, wrong block name
    assert DiskKVTier(tmp_path, "b" * 32, 1 << 20).load(h(1), SHAPE, torch.float32) is not None
    assert tier.load(h(4), SHAPE, torch.float32) is None


def test_size_cap_evicts_least_recently_used(tmp_path):
    probe = DiskKVTier(tmp_path / "probe", FP, 1 << 20)
    probe.save(h(0), *kv(0))
    size = probe.bytes_stored
    tier = DiskKVTier(tmp_path / "kv", FP, 2 * size + size // 2)  # room for two blocks
    tier.save(h(1), *kv(1))
    tier.save(h(2), *kv(2))
    now = time.time_ns()
    os.utime(tier.path(h(1)), ns=(now - 200 * 10**9,) * 2)  # h(1) older than h(2) ...
    os.utime(tier.path(h(2)), ns=(now - 100 * 10**9,) * 2)
    assert tier.load(h(1), SHAPE, torch.float32) is not None  # ... until a hit makes it young
    tier.save(h(3), *kv(3))
    assert tier.path(h(1)).exists() and tier.path(h(3)).exists() and not tier.path(h(2)).exists()
    assert tier.bytes_stored == 2 * size
    total = sum(p.stat().st_size for p in (tmp_path / "kv").rglob(f"*{SUFFIX}"))
    assert total <= tier.max_bytes
    for i in range(4, 10):
        tier.save(h(i), *kv(i))
        assert sum(p.stat().st_size for p in (tmp_path / "kv").rglob(f"*{SUFFIX}")) <= tier.max_bytes


def test_cap_covers_every_fingerprint_folder(tmp_path):
    a = DiskKVTier(tmp_path, "a" * 32, 1 << 20)
    a.save(h(1), *kv(1))
    size = a.bytes_stored
    b = DiskKVTier(tmp_path, "b" * 32, size + size // 2)  # one block in all
    os.utime(a.path(h(1)), ns=(time.time_ns() - 100 * 10**9,) * 2)
    b.save(h(2), *kv(2))
    assert not a.path(h(1)).exists() and b.path(h(2)).exists()


def test_unwritable_folder_degrades_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="mm_kv_cache_management.disk_tier"):
        tier = DiskKVTier(blocker, FP, 1 << 20)
        assert tier.save(h(1), *kv(1)) is False
        assert tier.save(h(2), *kv(2)) is False
        assert tier.load(h(1), SHAPE, torch.float32) is None
    assert len([r for r in caplog.records if "not writable" in r.getMessage()]) == 1


def test_full_disk_degrades_with_one_warning_and_leaves_no_partial_file(tmp_path, caplog, monkeypatch):
    tier = DiskKVTier(tmp_path, FP, 1 << 20)
    tier.save(h(1), *kv(1))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with caplog.at_level(logging.WARNING, logger="mm_kv_cache_management.disk_tier"):
        assert tier.save(h(2), *kv(2)) is False
        assert tier.save(h(3), *kv(3)) is False
    assert len([r for r in caplog.records if "not writable" in r.getMessage()]) == 1
    assert sorted(p.name for p in (tmp_path / FP).iterdir()) == [h(1).hex() + SUFFIX]
    assert torch.equal(tier.load(h(1), SHAPE, torch.float32)[1], kv(1)[1])  # reads go on


_HOLD = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
os.write(fd, b"half a block")
fcntl.flock(fd, fcntl.LOCK_EX)  # as write_atomic holds it while writing
print("locked", flush=True)
time.sleep(60)
"""


def _writer(path) -> subprocess.Popen:
    """A process writing ``path`` as the tier does (its lock held), stopped mid-write."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_temporaries_of_a_killed_writer_are_removed_at_start(tmp_path):
    """issue 33: a SIGKILL during a write left a .part file (outside the byte cap) that stayed
    after the restart; now the next tier opened on the folder deletes it at once, in any
    fingerprint folder, and keeps the one a live writer still holds."""
    (tmp_path / FP).mkdir()
    (tmp_path / ("b" * 32)).mkdir()
    killed, live = tmp_path / FP / ".tmp-killed.kvb.part", tmp_path / FP / ".tmp-live.kvb.part"
    left = tmp_path / ("b" * 32) / ".tmp-left.kvs.part"
    left.write_bytes(b"half a snapshot")  # young, no lock: its writer is gone
    dead, alive = _writer(killed), _writer(live)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        tier = DiskKVTier(tmp_path, FP, 1 << 20)
        assert not killed.exists() and not left.exists() and live.exists() and tier.bytes_stored == 0
        assert tier.save(h(1), *kv(1)) and not [p for p in (tmp_path / FP).iterdir()
                                                 if p.name.endswith(".part") and p != live]
    finally:
        alive.kill()
        alive.wait(timeout=30)
    DiskKVTier(tmp_path, FP, 1 << 20)  # its writer gone too: removed by the next tier
    assert not live.exists()


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dir_max_bytes"):
        DiskKVTier(tmp_path, FP, 0)
    with pytest.raises(ValueError, match="fingerprint"):
        DiskKVTier(tmp_path, "", 1 << 20)


BIG = (4, 64, 8, 64)  # 1 MiB of K/V per block: a write is not one instant


def _big(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(BIG, generator=g), torch.randn(BIG, generator=g)


def _share_folder(root: str, role: str, n: int, barrier, results) -> None:
    """Child process. "write" / "write_reversed": write blocks 0..n-1 (the two writers race on
    every file); "read": poll each block until it appears (bounded), reading the very files
    being written. Puts (role, wrong or missing reads, reads, whether a damaged file was seen)."""
    tier = DiskKVTier(root, FP, 1 << 30)
    blocks = [_big(i) for i in range(n)]
    wrong = reads = 0
    barrier.wait(timeout=120)  # all three start together (spawn start-up times differ)
    if role.startswith("write"):
        for i in (reversed(range(n)) if role == "write_reversed" else range(n)):
            tier.save(h(i), *blocks[i])
    else:
        for i in range(n):
            got = None
            for _ in range(1_000_000):  # bounded: the writers need far fewer polls
                got = tier.load(h(i), BIG, torch.float32)
                if got is not None:
                    break
            reads += got is not None
            wrong += got is None or not (torch.equal(got[0], blocks[i][0]) and torch.equal(got[1], blocks[i][1]))
    for i in range(n):  # every block is there in the end, exact
        got = tier.load(h(i), BIG, torch.float32)
        wrong += got is None or not torch.equal(got[1], blocks[i][1])
    results.put((role, wrong, reads, tier._warned_corrupt))


def test_two_processes_share_a_folder_without_partial_reads(tmp_path):
    n = 16
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    roles = ("read", "write", "write_reversed")
    procs = [ctx.Process(target=_share_folder, args=(str(tmp_path), role, n, barrier, results)) for role in roles]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in roles:
            role, *rest = results.get(timeout=300)
            got[role] = rest
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for wrong, _, warned_corrupt in got.values():
        assert wrong == 0 and not warned_corrupt
    assert got["read"][1] == n  # the reader read every block, polling while they were written
    assert len(list((tmp_path / FP).glob(f"*{SUFFIX}"))) == n
    assert not [p for p in (tmp_path / FP).iterdir() if p.suffix != SUFFIX]


# ---- state snapshots (hybrid models): <hash>.kvs beside <hash>.kvb ----------------------------
CONV, REC = (3, 12, 3), (3, 2, 4, 4)  # [layers, conv_dim, kernel - 1], [layers, v_heads, k_dim, v_dim]


def state(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CONV, generator=g), torch.randn(REC, generator=g)


def test_a_snapshot_round_trips_beside_its_block_and_counts_in_the_cap(tmp_path):
    from mm_kv_cache_management.disk_tier import SNAPSHOT_SUFFIX

    tier = DiskKVTier(tmp_path, FP, 1 << 20)
    tier.save(h(1), *kv(0))
    conv, rec = state(0)
    assert tier.save_snapshot(h(1), conv, rec) is True and tier.save_snapshot(h(1), *state(1)) is False
    assert tier.contains(h(1), SNAPSHOT_SUFFIX) and not tier.contains(h(2), SNAPSHOT_SUFFIX)
    got = tier.load_snapshot(h(1), CONV, REC, torch.float32)
    assert got is not None and torch.equal(got[0], conv) and torch.equal(got[1], rec)
    assert torch.equal(tier.load(h(1), SHAPE, torch.float32)[0], kv(0)[0])  # the block file is untouched
    files = sorted(p.name for p in (tmp_path / FP).iterdir())
    assert files == [h(1).hex() + SUFFIX, h(1).hex() + SNAPSHOT_SUFFIX]
    total = sum(p.stat().st_size for p in (tmp_path / FP).iterdir())
    assert tier.bytes_stored == total and DiskKVTier(tmp_path, FP, 1 << 20).bytes_stored == total  # after a restart
    # a snapshot read with another layout is a miss, and its file is deleted
    assert tier.load_snapshot(h(1), CONV, (3, 2, 4, 5), torch.float32) is None
    assert not tier.contains(h(1), SNAPSHOT_SUFFIX) and tier.contains(h(1))


def test_the_cap_evicts_snapshot_files_too(tmp_path):
    from mm_kv_cache_management.disk_tier import SNAPSHOT_SUFFIX

    probe = DiskKVTier(tmp_path / "probe", FP, 1 << 20)
    probe.save_snapshot(h(0), *state(0))
    one = probe.bytes_stored
    tier = DiskKVTier(tmp_path / "kv", FP, 3 * one)
    for i in range(6):
        tier.save_snapshot(h(i), *state(i))
        assert sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*" + SNAPSHOT_SUFFIX)) <= 3 * one
    assert tier.contains(h(5), SNAPSHOT_SUFFIX) and not tier.contains(h(0), SNAPSHOT_SUFFIX)  # oldest went first
