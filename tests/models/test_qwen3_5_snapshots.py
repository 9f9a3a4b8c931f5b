"""A Gated DeltaNet prefill that snapshots its state (meta.state.snapshots, for prefix caching
of hybrid models): split at the snapshot points it gives the unsplit chunk's outputs and final
state (up to fp32 rounding), and each snapshot is the state the layer has after exactly that
many tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atlas_vlm.models.qwen3_5.gated_deltanet import GatedDeltaNet
from mm_kv_cache_management import StateCache, StateMetadata
from qwen3_5_helpers import tiny_config

pytestmark = pytest.mark.text
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 rounding of a differently chunked sum


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    layer = GatedDeltaNet(tiny_config().text_config, state_layer=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer


def run(layer, x, cache, slot, has_state, snapshots=None, snapshot_cache=None):
    n = x.shape[0]
    state = StateMetadata(cache, torch.tensor([slot]), torch.tensor([has_state]),
                          None if snapshots is None else [snapshots], snapshot_cache)
    meta = SimpleNamespace(query_lens=[n], context_lens=[n + (1000 if has_state else 0)], state=state)
    with torch.no_grad():
        return layer(x, meta)


@pytest.mark.parametrize("continues", [False, True], ids=["from_zero", "continuing"])
def test_split_prefill_equals_unsplit_and_snapshots_are_prefix_states(layer, continues):
    spec_cache = lambda n: StateCache(layer_spec(layer), n)  # noqa: E731
    x = torch.randn(37, 64)
    head = torch.randn(5, 64)  # an earlier chunk, when the chunk continues a state
    plain, split, pool = spec_cache(1), spec_cache(1), spec_cache(3)
    if continues:
        run(layer, head, plain, 0, False)
        run(layer, head, split, 0, False)
    ref = run(layer, x, plain, 0, continues)
    out = run(layer, x, split, 0, continues, snapshots=[(8, 0), (16, 1), (37, 2)], snapshot_cache=pool)
    close(out, ref)
    close(split.conv, plain.conv)
    close(split.recurrent, plain.recurrent)
    for slot, k in enumerate((8, 16, 37)):  # the state after the first k tokens, computed alone
        alone = spec_cache(1)
        if continues:
            run(layer, head, alone, 0, False)
        run(layer, x[:k], alone, 0, continues)
        close(pool.conv[0, slot], alone.conv[0, 0])
        close(pool.recurrent[0, slot], alone.recurrent[0, 0])


def layer_spec(layer):
    from mm_kv_cache_management import StateSpec

    return StateSpec(num_layers=1, conv_dim=layer.conv_dim, conv_kernel=layer.kernel, num_v_heads=layer.num_v_heads,
                     k_head_dim=layer.head_k_dim, v_head_dim=layer.head_v_dim)
