"""M-RoPE positions of one request: ``get_rope_index`` and ``decode_position``.

Scope: the 3-axis (temporal, height, width) rotary positions that Qwen2.5-VL's decoder
uses, for images only, for ONE request (no batch, no padding). The rule is HF transformers'
``Qwen2_5_VLModel.get_rope_index`` (modeling_qwen2_5_vl.py, v4.57.6): text tokens get the
same position on all 3 axes, counting on from ``max(previous positions) + 1``; the merged
patches of an image get ``(0, row, col)`` offset by the position where the image starts
(images have ``second_per_grid_t = 0``, so the temporal index is 0 on every frame).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["get_rope_index", "decode_position"]


def get_rope_index(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: Sequence[Sequence[int]] | torch.Tensor,
    *,
    spatial_merge_size: int = 2,
    image_token_id: int,
    vision_start_token_id: int,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions ``[3, N]`` (int64) and ``rope_delta`` for one request of N tokens.

    Args:
        input_ids: ``[N]`` token ids, each image already expanded to its run of
            ``t*h*w // spatial_merge_size**2`` ``image_token_id`` tokens, preceded by
            ``vision_start_token_id``.
        image_grid_thw: ``[num_images, 3]`` grids ``(t, h, w)`` in patches, in prompt order.
        spatial_merge_size: patches merged per side into one token (2).

    Returns:
        ``(positions, rope_delta)``: positions ``[3, N]`` int64, rows (t, h, w);
        ``rope_delta = positions.max() + 1 - N`` (0 for text only). Equal to HF's
        ``get_rope_index`` on the same ids (batch of one, no attention mask).

    Raises:
        ValueError: empty ids, an image run not preceded by ``<|vision_start|>``, a run whose
            length differs from its grid, or a different number of runs and grids.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [int(x) for x in input_ids]
    grids = [tuple(int(v) for v in g) for g in (
        image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else image_grid_thw)]
    n = len(ids)
    if n == 0:
        raise ValueError("input_ids is empty")
    chunks: list[torch.Tensor] = []  # each [3, len]
    next_pos, st, img = 0, 0, 0
    while True:
        try:
            ed = ids.index(image_token_id, st)
        except ValueError:
            ed = n
        if ed > st:  # text run st..ed
            chunks.append(torch.arange(next_pos, next_pos + ed - st).view(1, -1).expand(3, -1))  # [3, len]
            next_pos += ed - st
        if ed == n:
            break
        if img >= len(grids):
            raise ValueError(f"image token at index {ed} but only {len(grids)} image_grid_thw entries")
        if ed == 0 or ids[ed - 1] != vision_start_token_id:
            raise ValueError(f"image token run at index {ed} is not preceded by <|vision_start|>")
        t, h, w = grids[img]
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        count = t * gh * gw
        if ids[ed:ed + count] != [image_token_id] * count:
            raise ValueError(f"image {img} at index {ed}: expected {count} image tokens for grid {grids[img]}")
        t_idx = torch.zeros(count, dtype=torch.long)
        h_idx = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten()  # [t, gh, gw] -> [count]
        w_idx = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten()  # [t, gh, gw] -> [count]
        block = torch.stack([t_idx, h_idx, w_idx]) + next_pos  # [3, count]
        chunks.append(block)
        next_pos = int(block.max()) + 1
        st, img = ed + count, img + 1
    if img != len(grids):
        raise ValueError(f"{len(grids)} image_grid_thw entries but {img} image runs in input_ids")
    positions = torch.cat(chunks, dim=1).to(torch.long)  # [3, N]
    return positions, next_pos - n


def decode_position(context_len: int, rope_delta: int) -> int:
    """Position of the next token after ``context_len`` tokens (same on all 3 M-RoPE axes).

    HF transformers' rule for cached generation: ``position = cache_position + rope_delta``,
    where ``rope_delta`` is this request's value from :func:`get_rope_index`.
    """
    return int(context_len) + int(rope_delta)
