"""Tests of mm_token_pipeline.get_rope_index and decode_position.

Case C09 of /work/shared/cases/cases.json exactly, and equality with HF transformers'
``Qwen2_5_VLModel.get_rope_index`` on random id sequences with 0..3 images of random grids.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from helpers import mm_token_type_ids

from mm_token_pipeline import decode_position, get_rope_index

pytestmark = pytest.mark.vlm

IMG, VS, VE = 151655, 151652, 151653


@pytest.fixture(scope="module")
def hf_model(tiny_models):
    """The session's tiny random Qwen2.5-VL (tests/conftest.py)."""
    return tiny_models["qwen2_5_vl"][1]


def test_c09_exact():
    a, b, c, d = 10, 11, 12, 13
    ids = [a, b, VS] + [IMG] * 4 + [c, VS] + [IMG] * 4 + [d]
    positions, delta = get_rope_index(ids, [(1, 4, 4), (1, 4, 4)], spatial_merge_size=2,
                                      image_token_id=IMG, vision_start_token_id=VS)
    assert positions.dtype == torch.int64 and positions.shape == (3, 14)
    assert positions[0].tolist() == [0, 1, 2, 3, 3, 3, 3, 5, 6, 7, 7, 7, 7, 9]
    assert positions[1].tolist() == [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 7, 8, 8, 9]
    assert positions[2].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 7, 8, 9]
    assert delta == -4
    assert decode_position(len(ids), delta) == 10


def test_text_only():
    positions, delta = get_rope_index(torch.tensor([5, 6, 7]), [], image_token_id=IMG, vision_start_token_id=VS)
    assert positions.tolist() == [[0, 1, 2]] * 3 and delta == 0
    assert decode_position(3, 0) == 3


def random_request(rng: random.Random):
    """Random ids with 0..3 images of random grids; returns (ids, grids)."""
    ids, grids = [], []
    for _ in range(rng.randint(0, 3)):
        ids += [rng.randint(0, 151000) for _ in range(rng.randint(0, 6))] + [VS]
        grid = (1, 2 * rng.randint(1, 5), 2 * rng.randint(1, 5))
        grids.append(grid)
        ids += [IMG] * (grid[1] * grid[2] // 4) + ([VE] if rng.random() < 0.8 else [])
    ids += [rng.randint(0, 151000) for _ in range(rng.randint(0 if ids else 1, 6))]
    return ids, grids


@pytest.mark.parametrize("seed", range(40))
def test_equals_hf_get_rope_index(hf_model, seed):
    ids, grids = random_request(random.Random(seed))
    ours, delta = get_rope_index(ids, grids, spatial_merge_size=2, image_token_id=IMG, vision_start_token_id=VS)
    grid_tensor = torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if grids else None
    hf_ids = torch.tensor([ids])
    hf_pos, hf_delta = hf_model.model.get_rope_index(hf_ids, mm_token_type_ids(hf_ids), grid_tensor)
    assert torch.equal(ours, hf_pos[:, 0, :])  # HF: [3, batch=1, N]
    assert delta == int(hf_delta[0, 0])
    assert decode_position(len(ids), delta) == int(ours.max()) + 1


def test_errors_are_clear():
    with pytest.raises(ValueError, match="empty"):
        get_rope_index([], [], image_token_id=IMG, vision_start_token_id=VS)
    with pytest.raises(ValueError, match="expected 4 image tokens"):
        get_rope_index([1, VS, IMG, IMG, 2], [(1, 4, 4)], image_token_id=IMG, vision_start_token_id=VS)
    with pytest.raises(ValueError, match=re.escape("not preceded by <|vision_start|>")):
        get_rope_index([1] + [IMG] * 4, [(1, 4, 4)], image_token_id=IMG, vision_start_token_id=VS)
    with pytest.raises(ValueError, match="2 image_grid_thw entries but 1 image runs"):
        get_rope_index([VS] + [IMG] * 4, [(1, 4, 4)] * 2, image_token_id=IMG, vision_start_token_id=VS)
    with pytest.raises(ValueError, match="only 0 image_grid_thw"):
        get_rope_index([VS] + [IMG] * 4, [], image_token_id=IMG, vision_start_token_id=VS)
