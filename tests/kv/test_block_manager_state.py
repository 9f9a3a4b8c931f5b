"""A hybrid model's state slots handed out with the blocks (BlockManager(state_cache=...)), the
step's StateMetadata (input_prep.state_metadata), and the StateSpec read from a config."""

import pytest
import torch
from transformers import Qwen3_5TextConfig

from helpers import make_req
from atlas_vlm.worker.input_prep import state_metadata
from mm_kv_cache_management import BlockManager, NoFreeBlocksError, StateCache, StateSpec, state_spec_from_config

pytestmark = pytest.mark.text
SPEC = StateSpec(num_layers=2, conv_dim=8, conv_kernel=4, num_v_heads=2, k_head_dim=4, v_head_dim=4)


def test_admission_takes_a_slot_and_every_free_gives_it_back():
    cache = StateCache(SPEC, num_slots=2)
    bm = BlockManager(num_blocks=16, block_size=4, state_cache=cache)
    a, b, c = make_req("a", 5), make_req("b", 3, start=100), make_req("c", 2, start=200)
    bm.prefill_allocate(a)
    bm.prefill_allocate(b)
    assert (a.state_slot, b.state_slot) == (0, 1) and cache.num_free_slots == 0
    assert not bm.can_allocate(c)  # blocks are free, no slot is
    with pytest.raises(NoFreeBlocksError, match="state slot"):
        bm.prefill_allocate(c)
    assert c.block_table is None and c.state_slot is None  # nothing taken
    bm.free_request(a)
    bm.free_request(a)  # idempotent: the slot is not freed twice
    assert a.state_slot is None and cache.num_free_slots == 1
    bm.prefill_allocate(c)
    assert c.state_slot == 0
    bm.free_request(b)
    bm.free_request(c)
    assert cache.num_free_slots == 2 and bm.num_free_blocks == 16


def test_state_cache_with_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="without prefix caching"):
        BlockManager(8, 4, enable_prefix_caching=True, state_cache=StateCache(SPEC, 1))


def test_state_metadata_marks_chunks_that_continue_a_state():
    cache = StateCache(SPEC, num_slots=3)
    bm = BlockManager(num_blocks=16, block_size=4, state_cache=cache)
    first, later = make_req("first", 6), make_req("later", 9, start=50)
    bm.prefill_allocate(later)
    bm.prefill_allocate(first)
    bm.commit_computed(later, 4)  # a second chunk starts at token 4
    meta = state_metadata([(first, 6), (later, 5)], cache)
    assert meta.cache is cache
    assert meta.slots.tolist() == [1, 0] and meta.has_initial_state.tolist() == [False, True]
    with pytest.raises(ValueError, match="hold no state slot"):
        state_metadata([(make_req("x", 2, start=300), 2)], cache)


def test_state_spec_from_a_qwen3_5_config():
    cfg = Qwen3_5TextConfig(num_hidden_layers=8, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    spec = state_spec_from_config(cfg)
    assert cfg.layer_types.count("linear_attention") == 6  # 3 of every 4
    assert spec == StateSpec(num_layers=6, conv_dim=2 * 2 * 16 + 4 * 8, conv_kernel=4, num_v_heads=4,
                             k_head_dim=16, v_head_dim=8)
    assert torch.Size(spec.recurrent_shape) == torch.Size([4, 16, 8])


def test_plain_configs_have_no_state():
    from transformers import LlamaConfig

    assert state_spec_from_config(LlamaConfig(num_hidden_layers=2)) is None
