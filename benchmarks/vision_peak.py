"""Measure the vision tower's peak activation memory against ``memory_plan``'s estimate.

Builds the real-width Qwen2.5-VL-3B tower (random weights, bundled config, ``--depth``
blocks: the peak is per block) and runs one image of ``--max-pixels`` through it on CPU in
fp32, reporting the peak RSS growth of the forward next to the live-tensor sum
(``vision_activation_peak / VISION_PEAK_FACTOR``) and the planned figure. This is how the
factor in ``atlas_vlm.memory_plan.VISION_PEAK_FACTOR`` was chosen.

    python benchmarks/vision_peak.py [--depth 2] [--max-pixels 1003520]
"""

from __future__ import annotations

import argparse
import gc
import resource

import torch
from transformers import AutoConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)

from atlas_vlm.entrypoints.plan import BUNDLED_CONFIGS
from atlas_vlm.memory_plan import VISION_PEAK_FACTOR, vision_activation_peak
from mm_token_pipeline import smart_resize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--max-pixels", type=int, default=1280 * 28 * 28)
    args = p.parse_args()
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(BUNDLED_CONFIGS / "Qwen2.5-VL-3B-Instruct")
    vision = config.vision_config
    vision.depth, vision.fullatt_block_indexes = args.depth, [args.depth - 1]
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision, dtype=torch.float32).eval()
    h, w = smart_resize(args.max_pixels // 1000, 1000, factor=28, max_pixels=args.max_pixels)  # a wide image
    grid_h, grid_w = h // 14, w // 14
    x = torch.randn(grid_h * grid_w, 3 * 2 * 14 * 14)  # [patches, patch_dim]
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.no_grad():
        tower(x, grid_thw=torch.tensor([[1, grid_h, grid_w]]))
    measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    planned = vision_activation_peak(config, grid_h * grid_w * 14 * 14, 4)
    print(f"patches {grid_h * grid_w}: measured peak {measured / 1e6:.0f} MB, live-tensor sum "
          f"{planned / VISION_PEAK_FACTOR / 1e6:.0f} MB, planned {planned / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
