"""The rollback of Qwen3.5's recurrent state over rejected drafts (speculative decoding on a
hybrid model), at the layer: a verification step of ``k + 1`` rows (``meta.state.num_drafts``)
followed by ``StateCache.accept_rows(slot, j + 1)`` leaves every Gated DeltaNet layer's conv
and recurrent state where decoding those ``j + 1`` tokens one by one leaves it, and where one
prefill chunk of them does (within 2e-6 fp32: the projections into the layer round apart
over 1, ``j + 1`` or ``k + 1`` rows; one token more moves it 1000x that); its rows' logits
equal the one-by-one decode's (1e-5). Through the C decode kernel and through the PyTorch path, a
verification sequence batched with a plain decode and another verification of other ``k``."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm.kernels import gated_delta
from atlas_vlm.loader import load_model
from atlas_vlm.models.qwen3_5.gated_deltanet import GatedDeltaNet
from qwen3_5_helpers import StepDriver, VOCAB, build_tiny_qwen3_5

pytestmark = pytest.mark.text
LOGIT_ATOL, STATE_ATOL = 1e-5, 2e-6


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35_rollback") / "text"
    build_tiny_qwen3_5(folder, text_only=True)
    return load_model(folder).model


@pytest.fixture(params=["kernel", "pytorch"])
def path(request, monkeypatch):
    """The one-row path of the linear-attention layers: the C kernel (asserted built) or PyTorch's rule."""
    if request.param == "kernel":
        assert gated_delta.available(), "the C decode kernel did not build: its path would go untested"
    else:
        monkeypatch.setattr(GatedDeltaNet, "_kernel_serves", lambda self, x, state: False)
    return request.param


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def state_of(run: StepDriver, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    slot = run.seqs[name]["slot"]
    return run.state.conv[:, slot].clone(), run.state.recurrent[:, slot].clone()


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_accepting_j_drafts_leaves_the_state_of_j_plus_one_decodes(model, path, accepted):
    prompts = {"plain": ids(7, 1), "v3": ids(9, 2), "v2": ids(5, 3)}
    rows = {"plain": ids(1, 4), "v3": ids(4, 5), "v2": ids(3, 6)}  # last sampled token + drafts
    spec = StepDriver(model)
    for name, p in prompts.items():
        spec.add(name)
        spec.step({name: p})
    logits = spec.step(rows, drafts={"v3": 3, "v2": 2})
    cases = {"v3": min(accepted, 3), "v2": min(accepted, 2)}
    for name, j in cases.items():
        spec.state.accept_rows(spec.seqs[name]["slot"], j + 1)
    for name, j in cases.items():
        one_by_one, chunk = StepDriver(model), StepDriver(model)
        for run in (one_by_one, chunk):
            run.add(name)
            run.step({name: prompts[name]})
        decoded = [one_by_one.step({name: [t]})[name][0] for t in rows[name][:j + 1]]
        chunk.step({name: rows[name][:j + 1]})
        conv, rec = state_of(spec, name)
        ref_conv, ref_rec = state_of(one_by_one, name)
        for ref in (state_of(one_by_one, name), state_of(chunk, name)):
            for ours, want in zip((conv, rec), ref):  # in_proj over 1 / j+1 / k+1 rows rounds apart: 1e-6
                assert (ours - want).abs().max().item() < STATE_ATOL, f"{name}: state after {j} accepted"
        if j + 1 < len(rows[name]):  # the test can fail: one token more moves the state far past the tolerance
            one_by_one.step({name: [rows[name][j + 1]]})
            assert (rec - state_of(one_by_one, name)[1]).abs().max().item() > 1e3 * STATE_ATOL
        for r, want in enumerate(decoded):  # the verified rows are the decodes' logits
            assert (logits[name][r] - want).abs().max().item() < LOGIT_ATOL
    assert spec.state._rows == {}  # every kept row dropped by accept_rows


def test_malformed_verification_is_refused(model):
    run = StepDriver(model)
    run.add("a")
    with pytest.raises(ValueError, match="drafts need 3 rows continuing a state"):
        run.step({"a": ids(3, 7)}, drafts={"a": 2})  # a first chunk cannot verify drafts
    run = StepDriver(model)
    run.add("a")
    run.step({"a": ids(4, 8)})
    with pytest.raises(ValueError, match="2 drafts need 3 rows"):
        run.step({"a": ids(4, 9)}, drafts={"a": 2})
    with pytest.raises(ValueError, match="kept no verification rows"):
        run.state.accept_rows(run.seqs["a"]["slot"], 1)
