"""Default CPU threads: the cores the process may run on (its affinity mask, as llama.cpp),
never the load average; ``num_threads`` and ``OMP_NUM_THREADS`` override; OpenMP waits
passively unless the user set a policy, set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from atlas_vlm import hardware

pytestmark = pytest.mark.text


@pytest.mark.parametrize("affinity", [{0}, {0, 1}, {0, 2, 5, 7}])
def test_default_threads_are_the_affinity_whatever_the_load(monkeypatch, tmp_path, affinity):
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: set(affinity))
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (7.5, 7.5, 7.5), raising=False)  # busy: not read
    assert hardware.usable_cpus(str(tmp_path)) == len(affinity)  # no cgroup quota here
    monkeypatch.setattr(hardware, "usable_cpus", lambda: len(hardware.os.sched_getaffinity(0)))
    assert hardware.default_num_threads() == len(affinity)
    assert hardware.default_num_threads(cpus=0) == 1  # at least one


def test_apply_num_threads_default_and_overrides(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(hardware, "usable_cpus", lambda: 1)
        monkeypatch.setattr(hardware, "_threads_chosen", False)
        torch.set_num_threads(2)
        assert hardware.apply_num_threads(None) == 1  # the affinity's one core
        assert hardware.apply_num_threads(2) == 2  # num_threads wins
        monkeypatch.setattr(hardware, "_threads_chosen", False)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert hardware.apply_num_threads(None) == 2  # OMP_NUM_THREADS stands: torch's count left as it is
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("user, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_wait_policy_is_passive_before_torch_loads(user, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if user is not None:
        env["OMP_WAIT_POLICY"] = user
    code = "import os, sys, atlas_vlm; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [expected, "False"]
