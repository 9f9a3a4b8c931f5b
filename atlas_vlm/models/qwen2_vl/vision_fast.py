"""Our forward of the Qwen2.5-VL / Qwen2-VL vision towers: ``FastQwenVisionTower``.

The same network as HF's ``Qwen2_5_VisionTransformerPretrainedModel`` /
``Qwen2VisionTransformerPretrainedModel`` (built from a loaded HF tower: its weights, the
same state dict names before the swap), with the CPU costs of HF's forward removed:

- the patch embedding (a ``Conv3d`` whose stride is its kernel) is one linear over the
  flattened patch, ``[num_patches, 1176] @ W^T``;
- the MLP's ``gate_proj`` and ``up_proj`` are one fused linear (Qwen2.5-VL); every linear is
  an ``nn.Linear``, so ``layers.linear.pack_linears`` packs them for oneDNN in bf16;
- attention runs one SDPA call per run of equal-length segments ``[count, heads, len,
  head_dim]`` (no mask, no padding, no per-window loop): the window permutation is done once
  per forward, and it orders each frame's windows by size (windows are independent, so any
  order is the same network), which makes the full windows one run;
- the rotary embedding is applied to q and k in one pass (fp32, as HF) without ``cat``.

Outputs equal HF's within float rounding (fp32 within 1e-4; ``tests/token_pipeline/
test_vision_fast.py``). ``VisionEncoder`` picks this tower where ``fast_tower_unsupported``
returns None and keeps HF's tower otherwise (the reference).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

__all__ = ["FastQwenVisionTower", "fast_tower_unsupported", "tower_choice", "FAST_TOWER_ENV", "TOWER_CHOICES"]

FAST_TOWER_ENV = "ATLAS_VLM_VISION_TOWER"  # "hf": HF's tower; unset / "fast": ours where it applies; "int8": ours, int8
TOWER_CHOICES = ("fast", "hf", "int8")


def tower_choice() -> str:
    """``ATLAS_VLM_VISION_TOWER`` (lower case; unset or empty: "fast").

    Raises:
        ValueError: a value not in ``TOWER_CHOICES``."""
    choice = os.environ.get(FAST_TOWER_ENV, "").strip().lower() or "fast"
    if choice not in TOWER_CHOICES:
        raise ValueError(f"{FAST_TOWER_ENV} must be one of {TOWER_CHOICES}, got {choice!r}")
    return choice


def fast_tower_unsupported(hf_tower: nn.Module) -> str | None:
    """Why ``FastQwenVisionTower`` cannot replace ``hf_tower``, or None when it can.

    It can for HF's Qwen2.5-VL / Qwen2-VL towers with an even head dim, unless the
    environment variable ``ATLAS_VLM_VISION_TOWER`` is ``"hf"``."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    if tower_choice() == "hf":
        return f"{FAST_TOWER_ENV}=hf"
    if not isinstance(hf_tower, (Qwen2_5_VisionTransformerPretrainedModel, Qwen2VisionTransformerPretrainedModel)):
        return f"{type(hf_tower).__name__} is not a Qwen2.5-VL / Qwen2-VL tower"
    attn = hf_tower.blocks[0].attn if len(hf_tower.blocks) else None
    if attn is None or attn.head_dim % 2:
        return "the tower has no blocks or an odd head dim"
    return None


def _runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """``(start, count, length)`` per run of consecutive equal ``lengths`` (start in rows)."""
    runs, start = [], 0
    for n in lengths:
        if runs and runs[-1][2] == n:
            runs[-1][1] += 1
        elif n:
            runs.append([start, 1, n])
        start += n
    return [tuple(r) for r in runs]


class _Block(nn.Module):
    """One vision block over HF's modules: pre-norm attention + pre-norm MLP, residuals."""

    def __init__(self, blk: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = blk.norm1, blk.norm2  # RMSNorm (2.5) or LayerNorm (2)
        self.qkv, self.proj = blk.attn.qkv, blk.attn.proj
        self.heads, self.head_dim = blk.attn.num_heads, blk.attn.head_dim
        mlp = blk.mlp
        if hasattr(mlp, "gate_proj"):  # Qwen2.5-VL: down(act(gate(x)) * up(x)), gate and up fused
            g, u = mlp.gate_proj, mlp.up_proj
            self.fc1 = nn.Linear(g.in_features, 2 * g.out_features, bias=g.bias is not None,
                                 dtype=g.weight.dtype, device=g.weight.device)
            with torch.no_grad():
                self.fc1.weight.copy_(torch.cat([g.weight, u.weight]))
                if g.bias is not None:
                    self.fc1.bias.copy_(torch.cat([g.bias, u.bias]))
            self.fc2, self.act, self.gated = mlp.down_proj, mlp.act_fn, True
        else:  # Qwen2-VL: fc2(act(fc1(x)))
            self.fc1, self.fc2, self.act, self.gated = mlp.fc1, mlp.fc2, mlp.act, False

    def _attention(self, x, cos, sin, runs):
        n, h, d = x.shape[0], self.heads, self.head_dim
        qkv = self.qkv(x).view(n, 3, h, d)
        qk = qkv[:, :2].float()  # HF rotates in fp32: q*cos + rotate_half(q)*sin
        rot = qk * cos
        half = d // 2
        rot[..., :half].addcmul_(qk[..., half:], sin[..., :half], value=-1.0)
        rot[..., half:].addcmul_(qk[..., :half], sin[..., half:])
        rot = rot.to(x.dtype)
        q, k, v = rot[:, 0], rot[:, 1], qkv[:, 2]  # [n, heads, head_dim] each
        out = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
        for start, count, length in runs:
            end = start + count * length
            seg = [t[start:end].view(count, length, h, d).transpose(1, 2) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*seg)  # [count, heads, length, head_dim]
            out[start:end].view(count, length, h, d).copy_(o.transpose(1, 2))
        return self.proj(out.view(n, h * d))

    def forward(self, x, cos, sin, runs):
        x = x + self._attention(self.norm1(x), cos, sin, runs)
        y = self.fc1(self.norm2(x))
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = self.act(gate) * up
        else:
            y = self.act(y)
        return x + self.fc2(y)


class FastQwenVisionTower(nn.Module):
    """``hf_tower``'s network with our forward (module docstring); built by ``from_hf``.

    ``forward(pixel_values [num_patches, patch_dim], grid_thw [num_images, 3] long)`` returns
    ``[num_patches // merge**2, out_hidden_size]``, merged patches in HF's order.
    """

    def __init__(self, hf_tower: nn.Module):
        super().__init__()
        reason = fast_tower_unsupported(hf_tower)
        if reason is not None:
            raise ValueError(f"FastQwenVisionTower cannot run this tower: {reason}")
        conv = hf_tower.patch_embed.proj
        self.patch_embed = nn.Linear(conv.weight[0].numel(), conv.out_channels, bias=False,
                                     dtype=conv.weight.dtype, device=conv.weight.device)
        self.patch_embed.weight = nn.Parameter(conv.weight.detach().reshape(conv.out_channels, -1))
        self.rotary_pos_emb = hf_tower.rotary_pos_emb
        self.blocks = nn.ModuleList(_Block(b) for b in hf_tower.blocks)
        self.merger = hf_tower.merger
        cfg = hf_tower.config
        self.merge = cfg.spatial_merge_size
        self.windowed = hasattr(hf_tower, "fullatt_block_indexes")  # Qwen2.5-VL
        self.full_blocks = set(cfg.fullatt_block_indexes) if self.windowed else set(range(len(self.blocks)))
        self.window_args = dict(spatial_merge_size=self.merge, window_size=getattr(cfg, "window_size", 0),
                                patch_size=cfg.patch_size)

    @classmethod
    def from_hf(cls, hf_tower: nn.Module) -> "FastQwenVisionTower":
        """Build over a loaded HF tower (shares its tensors; the fused MLP weight is a copy).

        Raises:
            ValueError: ``fast_tower_unsupported(hf_tower)`` gives a reason."""
        return cls(hf_tower).eval()

    def quantize_int8(self) -> int:
        """Weight-only int8 (round to nearest, per-channel scales: ``Int8Linear.from_float``)
        for every block linear the quantized matmul kernel runs (``in_features`` a multiple
        of 32, kernel built); the others, the patch embed and the merger stay dense. fp32
        towers only: in bf16, rows beyond ``KERNEL_MAX_ROWS`` take the dequantized weight,
        slower than packed bf16. Returns the number quantized.

        Raises:
            ValueError: the tower is not fp32."""
        from atlas_vlm.layers.quant_linear import Int8Linear, quant_kernel_available

        if self.dtype != torch.float32:
            raise ValueError(f"the int8 vision tower needs dtype float32, got {self.dtype} (bf16 runs packed)")
        count = 0
        for blk in self.blocks:
            for name in ("qkv", "proj", "fc1", "fc2"):
                lin = getattr(blk, name)
                if isinstance(lin, nn.Linear) and lin.in_features % 32 == 0 and quant_kernel_available(lin.weight.device):
                    q = Int8Linear.from_float(lin).to(lin.weight.device)
                    q.finalize(True)
                    setattr(blk, name, q)
                    count += 1
        return count

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype."""
        return self.merger.ln_q.weight.dtype

    def _window_order(self, grid: torch.Tensor, frame_lengths: list[int]):
        """``(merged-unit order, window lengths in patches)``: HF's window index with each
        frame's windows sorted by size, largest first (stable)."""
        index, cu = get_vision_window_index(grid, **self.window_args)
        cu = cu.tolist()
        unit = self.merge ** 2
        windows, frame, frame_end = [], 0, frame_lengths[0] if frame_lengths else 0
        for a, b in zip(cu[:-1], cu[1:]):
            while a >= frame_end:
                frame += 1
                frame_end += frame_lengths[frame]
            windows.append((frame, -(b - a), a))
        windows.sort(key=lambda w: (w[0], w[1]))  # stable: HF's order within a size
        order = torch.cat([index[a // unit:(a - n) // unit] for _, n, a in windows])
        return order, [-n for _, n, _ in windows]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[sum t*h*w // merge**2, out_hidden_size]`` merged patches, images in order, for
        ``pixel_values [sum t*h*w, patch_dim]`` and ``grid_thw [num_images, 3]`` (long, in
        patches). Inputs are checked by ``VisionEncoder.forward``; not here."""
        grid = grid_thw.reshape(-1, 3)
        x = self.patch_embed(pixel_values.reshape(pixel_values.shape[0], -1).to(self.dtype))
        frames = torch.diff(get_vision_cu_seqlens(grid)).tolist()  # [t*images] patches per frame
        full_runs = _runs(frames)
        cos, sin = self.rotary_pos_emb(x, get_vision_position_ids(grid, self.merge))  # [n, head_dim] fp32
        order = None
        if self.windowed:
            order, window_lengths = self._window_order(grid, frames)
            unit = self.merge ** 2
            rows = (order[:, None] * unit + torch.arange(unit, device=order.device)).reshape(-1).to(x.device)
            x, cos, sin = x[rows], cos[rows], sin[rows]
            window_runs = _runs(window_lengths)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # broadcast over (q|k, heads)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, full_runs if i in self.full_blocks else window_runs)
        out = self.merger(x)  # [n / merge**2, out_hidden]
        if order is not None:
            out = out[torch.argsort(order).to(out.device)]
        return out
