"""``FastQwenVisionTower`` (atlas_vlm/models/qwen2_vl/vision_fast.py) against HF's tower, the reference.

Same weights, same pixels: fp32 within 1e-4 (tiny Qwen2.5-VL / Qwen2-VL from
tests/conftest.py and a mid-size random Qwen2.5-VL tower with partial windows, several
images and a 2-frame video grid), bf16 within bf16 rounding, packed bf16 linears the same
bits as plain ones; the engine's greedy tokens on an image prompt are the same with either
tower; ``ATLAS_VLM_VISION_TOWER=hf`` (the fast path faked off) gives HF's tower.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from helpers import IMAGES, conv
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers.linear import PackedLinear, can_pack, pack_linears
from atlas_vlm.models.qwen2_vl.vision import VisionEncoder
from mm_token_pipeline import load_image
from atlas_vlm.models.qwen2_vl.vision_fast import FAST_TOWER_ENV, FastQwenVisionTower, fast_tower_unsupported
from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image

pytestmark = pytest.mark.vlm

MID = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=96, patch_size=14,
           spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
           in_channels=3, hidden_act="silu")
# (t, h, w) in patches: full and partial windows (8x8 patches each), odd merged grids, 2 frames
GRIDS = [[1, 16, 16], [1, 20, 34], [2, 12, 8], [1, 6, 10]]


def _pair(config, state, dtype):
    """(HF's tower, ours) over the same state dict."""
    ref = VisionEncoder.from_state_dict(config, state, dtype=dtype, fast=False)
    ours = VisionEncoder.from_state_dict(config, state, dtype=dtype)
    assert ref.tower_kind == "hf" and ours.tower_kind == "fast"
    assert isinstance(ours.model, FastQwenVisionTower)
    return ref, ours


@pytest.fixture(scope="module")
def mid_state():
    """A random mid-size Qwen2.5-VL tower's state dict (std 0.05 so every block matters)."""
    gen = torch.Generator().manual_seed(0)
    enc = VisionEncoder(MID)
    return {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in enc.model.state_dict().items()}


def _pixels(grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 1176, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_tiny_towers_match_hf_fp32(tiny_models, family):
    hf = tiny_models[family][1]
    ref, ours = _pair(hf.config.vision_config, hf.model.visual.state_dict(), torch.float32)
    images = [preprocess_image(load_image(IMAGES / n), max_pixels=64 * 28 * 28) for n in ("chelsea.png", "camera.png")]
    with torch.no_grad():
        a, b = ref.encode(images), ours.encode(images)
    assert [x.shape for x in a] == [x.shape for x in b] == [(im.num_tokens, 64) for im in images]
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=0)
        assert x.abs().max() > 1e-2  # not a comparison of zeros


def test_mid_tower_matches_hf_fp32_over_partial_windows_and_frames(mid_state):
    ref, ours = _pair(MID, mid_state, torch.float32)
    px, grid = _pixels(GRIDS), torch.tensor(GRIDS)
    with torch.no_grad():
        a, b = ref(px, grid), ours(px, grid)
    assert a.shape == b.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 96)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    with torch.no_grad():  # one image alone = its rows of the batch
        alone = ours(_pixels(GRIDS)[:256], torch.tensor(GRIDS[:1]))
    torch.testing.assert_close(alone, b[:64], atol=1e-5, rtol=0)


def test_mid_tower_bf16_within_bf16_rounding_and_packing_keeps_bits(mid_state):
    ref32, _ = _pair(MID, mid_state, torch.float32)
    ref, ours = _pair(MID, mid_state, torch.bfloat16)
    px, grid = _pixels(GRIDS), torch.tensor(GRIDS)
    with torch.no_grad():
        exact, a, b = ref32(px, grid), ref(px, grid).float(), ours(px, grid).float()
    scale = exact.abs().max()
    hf_err, our_err = (a - exact).abs().max(), (b - exact).abs().max()
    assert our_err <= 2 * hf_err + 1e-3 * scale  # ours is as close to fp32 as HF's bf16 tower
    assert (b - a).abs().max() <= 2 ** -6 * scale  # a few bf16 ulps of the output's range
    if can_pack(torch.bfloat16, "cpu"):
        # blocks' qkv/proj/fc1(gate+up)/fc2 + patch embed + merger's 2
        assert pack_linears(ours) == 4 * MID["depth"] + 3
        assert any(isinstance(m, PackedLinear) for m in ours.modules())
        with torch.no_grad():
            assert torch.equal(ours(px, grid).float(), b)


def test_fallback_env_and_errors(mid_state, monkeypatch):
    """The fast path faked off (``ATLAS_VLM_VISION_TOWER=hf``) keeps HF's tower, whose
    answer is the fast one's within 1e-4; a bad value and ``fast=True`` without it raise."""
    px, grid = _pixels(GRIDS[:2]), torch.tensor(GRIDS[:2])
    fast = VisionEncoder.from_state_dict(MID, mid_state)
    monkeypatch.setenv(FAST_TOWER_ENV, "hf")
    off = VisionEncoder.from_state_dict(MID, mid_state)
    assert off.tower_kind == "hf" and type(off.model) is Qwen2_5_VisionTransformerPretrainedModel
    with torch.no_grad():
        torch.testing.assert_close(fast(px, grid), off(px, grid), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="fast=True but the fast vision tower cannot run here: ATLAS_VLM_VISION_TOWER=hf"):
        VisionEncoder.from_state_dict(MID, mid_state, fast=True)
    monkeypatch.setenv(FAST_TOWER_ENV, "turbo")
    with pytest.raises(ValueError, match=r"ATLAS_VLM_VISION_TOWER must be one of \('fast', 'hf', 'int8'\), got 'turbo'"):
        VisionEncoder.from_state_dict(MID, mid_state)
    monkeypatch.delenv(FAST_TOWER_ENV)
    assert "not a Qwen2.5-VL / Qwen2-VL tower" in fast_tower_unsupported(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="FastQwenVisionTower cannot run this tower"):
        FastQwenVisionTower.from_hf(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_engine_greedy_tokens_equal_with_either_tower(tiny_models, family, monkeypatch):
    folder = tiny_models[family][0]
    messages = conv(IMAGES / "chelsea.png", text="Describe this image.")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="float32", device="cpu", max_model_len=1024, num_kvcache_blocks=64)
    fast = LLM(str(folder), **kwargs)
    assert fast.engine.runner.vision.tower_kind == "fast"
    monkeypatch.setenv(FAST_TOWER_ENV, "hf")
    ref = LLM(str(folder), **kwargs)
    assert ref.engine.runner.vision.tower_kind == "hf"
    a, b = fast.chat(messages, params, use_tqdm=False)[0], ref.chat(messages, params, use_tqdm=False)[0]
    assert len(a.token_ids) == 8 and a.token_ids == b.token_ids
    assert len(a.logprobs) == 8
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
