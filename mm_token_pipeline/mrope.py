"""M-RoPE positions of one request: ``get_rope_index``, ``decode_position`` (Qwen3-VL's variant,
``get_rope_index_qwen3_vl``, lives in its family folder: ``atlas_vlm.models.qwen3_vl.mrope``).

Scope: the 3-axis (temporal, height, width) rotary positions of Qwen2-VL, Qwen2.5-VL and
Qwen3-VL decoders for ONE request (no batch, no padding), images and videos. The rule is HF
transformers 5.24's ``get_rope_index`` (``modeling_qwen2_vl.py``, ``modeling_qwen2_5_vl.py``,
``modeling_qwen3_vl.py``) with its ``get_vision_position_ids``:

- the ids split into runs of one kind (text, image pads, video pads: ``mm_token_type_ids``);
  a text run counts on from the current position ``p`` on all 3 axes;
- a vision run of grid ``(t, h, w)`` (``gh, gw = h // merge, w // merge``) gets, for token
  ``(i, r, c)`` in ``[t, gh, gw]`` order, ``(p + int(i * interval), p + r, p + c)``; then
  ``p += max(gh, gw)`` (NOT ``max + 1``: for a video with ``int((t-1) * interval) >= max(gh, gw)``
  the following text starts below the video's largest temporal position, as in HF 5.24;
  4.57 used ``max + 1``; for images both agree);
- ``interval``: images 1; Qwen2-VL videos 1; Qwen2.5-VL videos ``tokens_per_second *
  second_per_grid_t`` in float32 (HF multiplies the config int by the processor's float32
  ``second_per_grid_ts`` tensor; ``.long()`` truncates); Qwen3-VL splits each video grid into
  ``t`` grids ``(1, h, w)``, one per timestamped run (``repeat_interleave``), interval 1;
- ``rope_delta = max(positions) + 1 - N``; decoding continues at ``cache_position + rope_delta``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["get_rope_index", "decode_position", "grid_rows", "run_positions"]


def grid_rows(value, name: str) -> list[tuple[int, int, int]]:
    """``(t, h, w)`` grids as int tuples (None: none). Raises ValueError naming ``name`` for a
    row that is not three values >= 1."""
    if value is None:
        return []
    rows = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    out = [tuple(int(v) for v in g) for g in rows]
    if any(len(g) != 3 or min(g) < 1 for g in out):
        raise ValueError(f"{name} rows must be (t, h, w) with every value >= 1, got {out}")
    return out


def run_positions(input_ids, kinds: dict[int, str], grids: dict[str, list], intervals: list,
               merge: int, vision_start_token_id: int) -> tuple[torch.Tensor, int]:
    """Positions ``[3, N]`` and rope_delta of ``input_ids`` whose vision runs (token id -> kind in
    ``kinds``) take ``grids[kind]`` in order (the module docstring's rule); ``intervals`` holds
    one float32 tensor (or 1) per video grid. A family's own position rule (Qwen3-VL's per-frame
    video grids: ``atlas_vlm.models.qwen3_vl.mrope``) builds on it."""
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [int(x) for x in input_ids]
    n = len(ids)
    if n == 0:
        raise ValueError("input_ids is empty")
    used = {kind: 0 for kind in grids}
    chunks: list[torch.Tensor] = []  # each [3, len]
    pos, st = 0, 0
    while st < n:
        kind = kinds.get(ids[st])
        ed = st
        while ed < n and kinds.get(ids[ed]) == kind:
            ed += 1
        if kind is None:  # text run st..ed
            chunks.append(torch.arange(pos, pos + ed - st).view(1, -1).expand(3, -1))  # [3, len]
            pos += ed - st
            st = ed
            continue
        k = used[kind]
        if k >= len(grids[kind]):
            raise ValueError(f"{kind} token at index {st} but only {len(grids[kind])} {kind}_grid_thw entries")
        if st == 0 or ids[st - 1] != vision_start_token_id:
            raise ValueError(f"{kind} token run at index {st} is not preceded by <|vision_start|>")
        t, h, w = grids[kind][k]
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if ed - st != count:
            raise ValueError(f"{kind} {k} at index {st}: expected {count} {kind} tokens for grid {grids[kind][k]}, "
                             f"got a run of {ed - st}")
        interval = intervals[k] if kind == "video" else 1
        t_idx = (torch.arange(t) * interval).long()  # HF get_vision_position_ids, before the offset
        block = torch.stack(torch.meshgrid(t_idx, torch.arange(gh), torch.arange(gw), indexing="ij")).reshape(3, -1)
        chunks.append(block + pos)  # [3, count]
        pos += max(gh, gw)
        used[kind], st = k + 1, ed
    for kind, rows in grids.items():
        if used[kind] != len(rows):
            raise ValueError(f"{len(rows)} {kind}_grid_thw entries but {used[kind]} {kind} runs in input_ids")
    positions = torch.cat(chunks, dim=1).to(torch.long)  # [3, N]
    return positions, int(positions.max()) + 1 - n


def get_rope_index(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    image_token_id: int,
    vision_start_token_id: int,
    video_token_id: int | None = None,
    video_grid_thw: Sequence[Sequence[int]] | torch.Tensor | None = None,
    second_per_grid_ts: Sequence[float] | torch.Tensor | None = None,
    tokens_per_second: float | None = None,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions ``[3, N]`` (int64) and ``rope_delta`` of Qwen2-VL / Qwen2.5-VL for N tokens.

    Args:
        input_ids: ``[N]`` token ids, each image / video expanded to its run of
            ``t*h*w // spatial_merge_size**2`` pads, preceded by ``vision_start_token_id``.
        image_grid_thw: ``[num_images, 3]`` grids ``(t, h, w)`` in patches, in prompt order.
        spatial_merge_size: patches merged per side into one token (2).
        video_token_id, video_grid_thw: the video pad id and ``[num_videos, 3]`` grids.
        second_per_grid_ts: seconds per temporal group per video (``ProcessedVideo.second_per_grid_t``;
            HF default 1 each when None); used only with ``tokens_per_second``.
        tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second`` (temporal interval
            ``tokens_per_second * second_per_grid_t``); None: Qwen2-VL's rule (interval 1).

    Returns:
        ``(positions, rope_delta)``: positions ``[3, N]`` int64, rows (t, h, w);
        ``rope_delta = positions.max() + 1 - N``. Equal to HF 5.24 ``get_rope_index``.

    Raises:
        ValueError: empty ids, a run not preceded by ``<|vision_start|>``, a run whose length
            differs from its grid, a different number of runs and grids (per modality), video
            grids without ``video_token_id``, or a ``second_per_grid_ts`` count mismatch.
    """
    videos = grid_rows(video_grid_thw, "video_grid_thw")
    if videos and video_token_id is None:
        raise ValueError("video_grid_thw given without video_token_id")
    intervals: list = [1] * len(videos)
    if tokens_per_second is not None:
        seconds = torch.ones(len(videos)) if second_per_grid_ts is None else \
            torch.as_tensor(second_per_grid_ts, dtype=torch.float32).reshape(-1)
        if len(seconds) != len(videos):
            raise ValueError(f"{len(seconds)} second_per_grid_ts for {len(videos)} video_grid_thw entries")
        intervals = [tokens_per_second * s for s in seconds]  # 0-dim float32 tensors, as HF
    kinds = {image_token_id: "image"}
    if video_token_id is not None:
        kinds[video_token_id] = "video"
    images = grid_rows(image_grid_thw, "image_grid_thw")
    return run_positions(input_ids, kinds, {"image": images, "video": videos}, intervals,
                         spatial_merge_size, vision_start_token_id)


def decode_position(context_len: int, rope_delta: int) -> int:
    """Position of the next token after ``context_len`` tokens (same on all 3 M-RoPE axes).

    HF transformers' rule for cached generation: ``position = cache_position + rope_delta``,
    where ``rope_delta`` is this request's value from :func:`get_rope_index`.
    """
    return int(context_len) + int(rope_delta)
