"""The recurrent-state slots of hybrid models (mm_kv_cache_management.state_cache)."""

import pytest
import torch

from mm_kv_cache_management import NoFreeStateSlotsError, StateCache, StateSpec

pytestmark = pytest.mark.text


def test_bytes_per_seq_counts_conv_and_recurrent_state_in_fp32():
    spec = StateSpec(num_layers=3, conv_dim=96, conv_kernel=4, num_v_heads=4, k_head_dim=16, v_head_dim=8)
    assert spec.bytes_per_seq == 3 * (96 * 3 + 4 * 16 * 8) * 4
    cache = StateCache(spec, num_slots=5)
    held = cache.conv.numel() * cache.conv.element_size() + cache.recurrent.numel() * cache.recurrent.element_size()
    assert held == 5 * spec.bytes_per_seq  # what the cache allocates is what the spec counts


def test_slots_are_lowest_first_zeroed_on_allocation_and_refused_when_full():
    cache = StateCache(StateSpec(2, 8, 4, 2, 4, 4), num_slots=2)
    a, b = cache.allocate(), cache.allocate()
    assert (a, b) == (0, 1) and cache.num_free_slots == 0
    cache.recurrent[:, a].fill_(3.0)
    cache.conv[:, a].fill_(2.0)
    with pytest.raises(NoFreeStateSlotsError, match="all 2 state slots"):
        cache.allocate()
    cache.free(a)
    assert cache.allocate() == a
    assert torch.count_nonzero(cache.recurrent[:, a]) == 0 and torch.count_nonzero(cache.conv[:, a]) == 0


def test_bad_slots_and_specs_are_named():
    cache = StateCache(StateSpec(1, 8, 4, 2, 4, 4), num_slots=1)
    with pytest.raises(ValueError, match="state slot 0 is not an allocated slot"):
        cache.free(0)
    with pytest.raises(ValueError, match="state slot 7"):
        cache.free(7)
    with pytest.raises(ValueError, match="conv_kernel must be >= 1"):
        StateSpec(1, 8, 0, 2, 4, 4)
    with pytest.raises(ValueError, match="at least one slot"):
        StateCache(StateSpec(1, 8, 4, 2, 4, 4), num_slots=0)
