"""The KV memory planner (``atlas_vlm.memory_plan``) on the four chain models' public configs
(``tests/data/configs``): every figure against arithmetic written out here, parameter counts
against HF models built on the meta device, and the engine's real KV allocation (CPU) and its
CUDA budget formula against the planner's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from helpers import REPO
from atlas_vlm import LLM
from atlas_vlm.config import EngineConfig
from atlas_vlm.entrypoints.plan import BUNDLED_CONFIGS as BUNDLED
from atlas_vlm.memory_plan import (ACTIVATION_RESERVE_BYTES, RUNTIME_OVERHEAD_BYTES, GiB, engine_max_pixels,
                                   kv_cache_spec, num_kv_blocks, plan, vision_activation_peak,
                                   visual_tokens_per_image)
from atlas_vlm.models.processor_settings import image_processor_settings
from atlas_vlm.models.param_count import text_params, vision_params
from atlas_vlm.worker.model_runner import kv_cache_budget_bytes

pytestmark = pytest.mark.text

CONFIGS = REPO / "tests" / "data" / "configs"
P = 1280 * 28 * 28  # 1,003,520 pixels: an explicit bound (the default is each checkpoint's own)
NAMES = ("Qwen3-VL-4B-Instruct", "Qwen2.5-VL-3B-Instruct", "SmolVLM2-2.2B-Instruct", "Qwen2.5-0.5B-Instruct")
# (layers x 2 (K, V) x kv heads x head_dim x 2 bytes) in bf16
KV_PER_TOKEN = {
    "Qwen3-VL-4B-Instruct": 36 * 2 * 8 * 128 * 2,  # 147456
    "Qwen2.5-VL-3B-Instruct": 36 * 2 * 2 * 128 * 2,  # 36864 (head_dim 2048 / 16)
    "SmolVLM2-2.2B-Instruct": 24 * 2 * 32 * 64 * 2,  # 196608 (no GQA)
    "Qwen2.5-0.5B-Instruct": 24 * 2 * 2 * 64 * 2,  # 12288 (head_dim 896 / 14)
}
# published sizes (model cards: 4.44B, 3.75B, 2.25B, 0.49B parameters)
PARAMS = {"Qwen3-VL-4B-Instruct": 4_437_815_808, "Qwen2.5-VL-3B-Instruct": 3_754_622_976,
          "SmolVLM2-2.2B-Instruct": 2_246_784_880, "Qwen2.5-0.5B-Instruct": 494_032_768}
VISUAL_TOKENS = {
    "Qwen3-VL-4B-Instruct": P // (16 * 2) ** 2,  # 980: patch 16, merge 2
    "Qwen2.5-VL-3B-Instruct": P // (14 * 2) ** 2,  # 1280
    "SmolVLM2-2.2B-Instruct": (3 * 3 + 1) * (384 // 14) ** 2 // 3**2,  # 810: side 1001 -> 3x3 tiles + global, 81 each
    "Qwen2.5-0.5B-Instruct": 0,
}
VISION_PEAK = {  # 2 (VISION_PEAK_FACTOR) x N patches x (5 d + 2 I) x 2 bytes
    "Qwen3-VL-4B-Instruct": 2 * (P // 16**2) * (5 * 1024 + 2 * 4096) * 2,  # 208,732,160
    "Qwen2.5-VL-3B-Instruct": 2 * (P // 14**2) * (5 * 1280 + 2 * 3420) * 2,  # 271,155,200
    "SmolVLM2-2.2B-Instruct": 2 * 10 * 27**2 * (5 * 1152 + 2 * 4304) * 2,  # 418,970,880
    "Qwen2.5-0.5B-Instruct": 0,
}


def config(name):
    return AutoConfig.from_pretrained(CONFIGS / name)


def test_qwen2_5_0_5b_by_hand():
    c = config("Qwen2.5-0.5B-Instruct")
    embed = 151936 * 896  # tied lm_head: counted once
    layer = 896 * (14 + 2 * 2) * 64 + 14 * 64 * 896 + (14 + 2 * 2) * 64 + 3 * 896 * 4864 + 2 * 896
    assert text_params(c) == embed + 24 * layer + 896 == 494_032_768
    p = plan(c, gpu_memory=24 * GiB, gpu_memory_utilization=0.9, max_model_len=4096, dtype="bf16")
    assert p.weight_bytes == 2 * 494_032_768
    assert (p.kv_bytes_per_token, p.kv_bytes_per_block) == (12288, 12288 * 16)
    budget = int(24 * GiB * 0.9) - (2 * 494_032_768 + RUNTIME_OVERHEAD_BYTES) - ACTIVATION_RESERVE_BYTES
    assert p.kv_budget_bytes == budget == 21_131_016_038
    assert p.num_blocks == budget // (12288 * 16) == 107_477
    assert p.max_num_seqs == 107_477 // (4096 // 16) == 419


@pytest.mark.parametrize("name", NAMES)
def test_planner_figures(name):
    c = config(name)
    p = plan(c, gpu_memory=80 * GiB, max_model_len=4096, max_pixels=P, dtype="bf16")
    assert p.kv_bytes_per_token == KV_PER_TOKEN[name]
    assert p.kv_bytes_per_block == 16 * KV_PER_TOKEN[name]
    assert p.weight_bytes == 2 * PARAMS[name]
    assert p.image_tokens == VISUAL_TOKENS[name]
    assert p.vision_peak_bytes == VISION_PEAK[name]
    used = p.weight_bytes + RUNTIME_OVERHEAD_BYTES + ACTIVATION_RESERVE_BYTES + VISION_PEAK[name]
    assert p.num_blocks == (int(80 * GiB * 0.9) - used) // (16 * KV_PER_TOKEN[name])
    assert p.max_num_seqs == p.num_blocks // 256
    fp32 = plan(c, gpu_memory=80 * GiB, max_model_len=4096, max_pixels=P, dtype="fp32")
    assert fp32.kv_bytes_per_token == 2 * KV_PER_TOKEN[name] and fp32.weight_bytes == 4 * PARAMS[name]


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_equal_hf_models_on_meta(name):
    c = config(name)
    auto = AutoModelForCausalLM if c.model_type == "qwen2" else AutoModelForImageTextToText
    with torch.device("meta"):
        hf = auto.from_config(c)
    total = sum(p.numel() for p in hf.parameters())  # tied tensors once
    vision = sum(p.numel() for n, p in hf.named_parameters() if any(k in n for k in ("visual", "vision", "connector")))
    assert text_params(c) + vision_params(c) == total == PARAMS[name]
    assert vision_params(c) == vision


def test_too_small_gpu_gets_no_blocks():
    p = plan(config("Qwen3-VL-4B-Instruct"), gpu_memory=8 * GiB)  # 7.2 GiB usable < 8.27 GiB of weights
    assert p.kv_budget_bytes == 0 and p.num_blocks == 0 and p.max_num_seqs == 0


def test_image_longer_than_the_sequence_fits_no_sequence():
    p = plan(config("Qwen2.5-VL-3B-Instruct"), max_model_len=1024, max_pixels=P)  # 1280 visual tokens > 1024
    assert p.num_blocks > 0 and p.max_num_seqs == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_5_vl"])
def test_engine_allocates_what_the_planner_says_on_cpu(tiny_models, family):
    folder = tiny_models[family][0]
    budget = (1 << 20) + 5000
    llm = LLM(str(folder), kv_cache_memory=budget, max_model_len=256, device="cpu", dtype="float32")
    runner = llm.engine.runner
    p = plan(AutoConfig.from_pretrained(folder), dtype="fp32")
    head_dim = {"qwen2": 64 // 4, "qwen3": 24, "qwen2_5_vl": 64 // 4}[family]
    assert p.kv_bytes_per_token == 2 * 2 * 2 * head_dim * 4  # layers x (K, V) x kv heads x head_dim x fp32
    assert runner.num_blocks == budget // p.kv_bytes_per_block
    assert runner.kv_cache.nbytes == runner.num_blocks * p.kv_bytes_per_block
    spec = kv_cache_spec(2, 2, head_dim, torch.float32)
    assert runner.num_blocks == num_kv_blocks(budget, spec, 16)


def test_engine_cuda_budget_is_the_planners_formula(monkeypatch):
    """The runner's CUDA budget with the device's memory replaced by the planner's figures
    (in use: weights + runtime overhead) equals the planner's budget."""
    c = config("Qwen2.5-VL-3B-Instruct")
    p = plan(c, gpu_memory=24 * GiB, gpu_memory_utilization=0.85, max_pixels=P, dtype="bf16")
    used = p.weight_bytes + RUNTIME_OVERHEAD_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (24 * GiB - used, 24 * GiB))
    cfg = EngineConfig(model="unused", gpu_memory_utilization=0.85, max_pixels=P, dtype="bfloat16")
    settings = image_processor_settings(BUNDLED / "Qwen2.5-VL-3B-Instruct", c)
    assert kv_cache_budget_bytes(cfg, torch.device("cuda"), c, engine_max_pixels(cfg, settings)) == p.kv_budget_bytes
    # no bound given: the engine and the planner both take the checkpoint's (12,845,056 pixels)
    default = plan(c, gpu_memory=24 * GiB, gpu_memory_utilization=0.85, dtype="bf16", image_settings=settings)
    cfg = EngineConfig(model="unused", gpu_memory_utilization=0.85, dtype="bfloat16")
    assert engine_max_pixels(cfg, settings) == default.max_pixels == 12845056 and default.image_tokens == 16384
    assert kv_cache_budget_bytes(cfg, torch.device("cuda"), c, engine_max_pixels(cfg, settings)) == default.kv_budget_bytes
    assert vision_activation_peak(c, P, 2) == VISION_PEAK["Qwen2.5-VL-3B-Instruct"]
    assert visual_tokens_per_image(c, P) == 1280


@pytest.mark.parametrize(("name", "seconds", "expected"), [
    # qwen-vl-utils at fps 2 from a 30 fps source: 2 frames a second (at least 4, even); per frame
    # min(768 tokens, 0.9 * 128000 tokens / frames * 2) of (patch * merge)**2 pixels
    ("Qwen2.5-VL-3B-Instruct", 10, (20, 768 * 28 * 28, 10 * 768)),
    ("Qwen2.5-VL-3B-Instruct", 1, (4, 768 * 28 * 28, 2 * 768)),
    ("Qwen3-VL-4B-Instruct", 10, (20, 768 * 32 * 32, 10 * 768)),
    ("Qwen2.5-VL-3B-Instruct", 600, (768, int(0.9 * 128000 / 768 * 2) * 28 * 28, 384 * int(0.9 * 128000 / 768 * 2))),
])
def test_video_tokens_per_clip_follow_qwen_vl_utils(name, seconds, expected):
    from atlas_vlm.memory_plan import video_tokens_per_clip

    assert video_tokens_per_clip(config(name), seconds) == expected


def test_smolvlm_video_tokens_need_its_video_sampling():
    from atlas_vlm.memory_plan import video_tokens_per_clip

    c = config("SmolVLM2-2.2B-Instruct")
    assert video_tokens_per_clip(c, 10) == (0, 0, 0)  # not stated: no guess
    per_frame = (384 // 14) ** 2 // c.scale_factor**2  # one 384 px square of 14 px patches, 4x4 pixel shuffle
    assert video_tokens_per_clip(c, 10, {"fps": 1, "max_frames": 64}) == (10, 384 * 384, 10 * per_frame)
    assert video_tokens_per_clip(c, 600, {"fps": 1, "max_frames": 64})[0] == 64


@pytest.mark.parametrize(("name", "tokens", "expected"), [
    ("Qwen2.5-VL-3B-Instruct", 1280, 1280 * 28 * 28),  # 1,003,520: a multiple of the 28x28 merged patch
    ("Qwen2.5-VL-3B-Instruct", 3072, 3072 * 28 * 28),
    ("Qwen3-VL-4B-Instruct", 3072, 3072 * 32 * 32),  # patch 16, merge 2
    # SmolVLM2: n x n tiles of 384 px (81 tokens each: 27**2 patches / 3**2) plus the global view past one
    ("SmolVLM2-2.2B-Instruct", 80, 0),  # not even one tile
    ("SmolVLM2-2.2B-Instruct", 81, 384**2),
    ("SmolVLM2-2.2B-Instruct", 5 * 81 - 1, 384**2),  # 2x2 tiles + global = 405 tokens: one short
    ("SmolVLM2-2.2B-Instruct", 5 * 81, 768**2),
    ("SmolVLM2-2.2B-Instruct", 10**6, 1536**2),  # capped at the processor's longest edge, 1536 px
])
def test_largest_image_pixels(name, tokens, expected):
    from atlas_vlm.memory_plan import largest_image_pixels

    c = config(name)
    assert largest_image_pixels(c, tokens) == expected
    if expected:
        assert visual_tokens_per_image(c, expected) <= tokens


def test_usable_image_is_three_quarters_of_l_at_most():
    p = plan(config("Qwen2.5-VL-3B-Instruct"), max_model_len=4096)  # the checkpoint's 16,384-token bound
    assert p.max_num_seqs == 0 and p.usable_max_pixels == 3072 * 28 * 28
    assert "the largest usable image is max_pixels=2,408,448" in p.why_not()
    small = plan(config("Qwen2.5-VL-3B-Instruct"), max_model_len=4096, max_pixels=P)  # fits: capped at the bound
    assert small.usable_max_pixels == P and small.fits


@pytest.mark.parametrize(("options", "expected"), [
    (dict(nframes=8), (8, 768 * 28 * 28, 4 * 768)),  # exactly 8 frames: 4 temporal groups
    (dict(fps=1.0), (10, 768 * 28 * 28, 5 * 768)),  # 10 s at 1 fps
    (dict(max_frames=6), (6, 768 * 28 * 28, 3 * 768)),  # fps 2 would give 20
])
def test_video_options_of_one_clip(options, expected):
    from atlas_vlm.memory_plan import video_tokens_per_clip

    assert video_tokens_per_clip(config("Qwen2.5-VL-3B-Instruct"), 10, **options) == expected
    c = config("SmolVLM2-2.2B-Instruct")  # no video_sampling in its config: the options state one
    per_frame = (384 // 14) ** 2 // c.scale_factor**2
    assert video_tokens_per_clip(c, 10, fps=2.0, max_frames=12) == (12, 384 * 384, 12 * per_frame)
    assert video_tokens_per_clip(c, 10, nframes=3) == (3, 384 * 384, 3 * per_frame)
