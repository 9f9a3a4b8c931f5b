"""``worker.pooler.pool_step`` without a model: "last" / "mean" over chunks of one step's
hidden rows, the running mean across steps (chunked prefill), a restart from token 0 (a
recompute after preemption) forgetting the old sum, and rows of other requests untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from atlas_vlm import PoolingParams
from atlas_vlm.worker.pooler import pool_step

pytestmark = pytest.mark.text


def req(n: int, params: PoolingParams | None, computed: int = 0, request_id: str = "r"):
    return SimpleNamespace(num_tokens=n, num_computed_tokens=computed, pooling_params=params, pooled_sum=None,
                           request_id=request_id)


def test_last_and_mean_from_one_step_skip_other_rows():
    torch.manual_seed(0)
    hidden = torch.randn(9, 8)
    gen, last = req(2, None, request_id="gen"), req(3, PoolingParams(normalize=False), request_id="last")
    mean = req(4, PoolingParams("mean", False), request_id="mean")
    pooled = pool_step([(gen, 2), (last, 3), (mean, 4)], hidden)
    assert sorted(pooled) == ["last", "mean"]  # the generation request is not pooled
    assert pooled["last"] == hidden[4].tolist()
    assert torch.allclose(torch.tensor(pooled["mean"]), hidden[5:9].mean(dim=0), atol=1e-6, rtol=0)


def test_mean_across_steps_and_restart():
    torch.manual_seed(1)
    rows = torch.randn(6, 8)
    r = req(6, PoolingParams("mean", normalize=True, dimensions=5))
    assert pool_step([(r, 4)], rows[:4]) == {} and r.pooled_sum is not None
    r.num_computed_tokens = 0  # preempted: recomputed from token 0, the first sum forgotten
    assert pool_step([(r, 2)], rows[:2] * 100) == {}
    r.num_computed_tokens = 2
    pooled = pool_step([(r, 4)], rows[2:])
    want = F.normalize(((rows[:2] * 100).sum(0) + rows[2:].sum(0))[:5] / 6, dim=0)
    assert torch.allclose(torch.tensor(pooled["r"]), want, atol=1e-6, rtol=0)
    assert r.pooled_sum is None
