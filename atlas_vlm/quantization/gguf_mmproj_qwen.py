"""The Qwen-VL projectors of a VLM GGUF pair: ``qwen2vl_merger`` (Qwen2-VL),
``qwen2.5vl_merger`` (Qwen2.5-VL) and ``qwen3vl_merger`` (Qwen3-VL), turned back into HF's
``vision_config``, image processor and ``visual.*`` tensors.

Source of the names: llama.cpp's ``conversion/qwenvl.py`` (Qwen2/2.5-VL: q/k/v split from HF's
fused ``qkv``), ``conversion/qwen3vl.py`` (Qwen3-VL: fused ``v.blk.N.attn_qkv``, the merger's
``linear_fc1`` / ``linear_fc2`` as ``mm.0`` / ``mm.2`` and its ``norm`` as ``v.post_ln``, the
DeepStack mergers as ``v.deepstack.N.{norm,fc1,fc2}`` with ``N`` the tower block they tap,
``clip.vision.is_deepstack_layers`` one flag per block, ``v.position_embd`` the learned
position table) and ``gguf-py/gguf/constants.py`` (``V_DS_NORM`` / ``V_DS_FC1`` / ``V_DS_FC2``);
all three split the Conv3D ``patch_embed`` into its temporal halves ``v.patch_embd.weight`` /
``v.patch_embd.weight.1``.

Values the mmproj header does not hold are the released checkpoints' (Qwen2.5-VL
``window_size`` 112 and ``tokens_per_second`` 2; Qwen3-VL's ``gelu_pytorch_tanh``; the
processor's ``min_pixels`` / ``max_pixels``: the family's ``FamilyHooks.processor_defaults``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from atlas_vlm.quantization.gguf_mmproj_names import TensorTaker, f32, field

__all__ = ["QwenVLPair", "QWEN2_VL", "QWEN2_5_VL", "QWEN3_VL"]

_BLOCK = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2"}
# per tower kind: the MLP names (llama.cpp -> HF), RMSNorms (weight only) or LayerNorms
_MLP = {"gated": {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
        "fc": {"ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
        "linear_fc": {"ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}}
_MERGER = {"mlp": {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"},
           "linear_fc": {"v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2"}}
_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


class QwenVLPair:
    """One Qwen-VL projector's layout (``model_type`` one of ``qwen2_vl`` / ``qwen2_5_vl`` /
    ``qwen3_vl``): image tokens ``<|image_pad|>`` ..., M-RoPE sections from the model GGUF."""

    special_tokens = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                      "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}

    def __init__(self, mlp: str, rms: bool, merger: str, deepstack: bool):
        self.mlp, self.rms, self.merger, self.deepstack = mlp, rms, merger, deepstack

    def text_config(self, model, arch: str, text: dict) -> dict:
        """``text`` plus the M-RoPE sections (``{arch}.rope.dimension_sections``, first three)."""
        sections = [int(x) for x in field(model, f"{arch}.rope.dimension_sections")][:3]
        rope = {"type": "mrope", "mrope_section": sections}
        if self.deepstack:  # Qwen3-VL: interleaved M-RoPE (HF Qwen3VLTextRotaryEmbedding)
            rope = {"rope_type": "default", "mrope_section": sections, "mrope_interleaved": True}
        return dict(text, rope_scaling=rope)

    def top_config(self, mm) -> dict:
        """Top-level config fields besides the token ids: none."""
        return {}

    def vision_config(self, mm) -> dict:
        """HF ``vision_config`` from the ``clip.vision.*`` keys and the tensors' shapes.

        Raises:
            ValueError: a key is missing, or Qwen2-VL's MLP width is no multiple of the width.
        """
        width = int(field(mm, "clip.vision.embedding_length"))
        common = dict(depth=int(field(mm, "clip.vision.block_count")),
                      num_heads=int(field(mm, "clip.vision.attention.head_count")),
                      patch_size=int(field(mm, "clip.vision.patch_size")),
                      spatial_merge_size=int(field(mm, "clip.vision.spatial_merge_size", 2)), temporal_patch_size=2,
                      in_channels=3)
        ffn, out = int(field(mm, "clip.vision.feed_forward_length")), int(field(mm, "clip.vision.projection_dim"))
        if self.mlp == "fc":  # Qwen2-VL
            if ffn % width:
                raise ValueError(f"mmproj: clip.vision.feed_forward_length {ffn} is no multiple of the width {width}, "
                                 f"as Qwen2-VL's mlp_ratio needs")
            return dict(common, embed_dim=width, hidden_size=out, mlp_ratio=ffn // width, hidden_act="quick_gelu")
        if self.deepstack:  # Qwen3-VL
            flags = [bool(x) for x in field(mm, "clip.vision.is_deepstack_layers", [])]
            pos = next(t for t in mm.tensors if t.name == "v.position_embd.weight")
            return dict(common, hidden_size=width, intermediate_size=ffn, out_hidden_size=out,
                        hidden_act="gelu_pytorch_tanh", num_position_embeddings=int(pos.shape[-1]),
                        deepstack_visual_indexes=[i for i, f in enumerate(flags) if f])
        n_wa = int(field(mm, "clip.vision.n_wa_pattern", common["depth"]))  # full attention every n_wa blocks
        return dict(common, hidden_size=width, intermediate_size=ffn, out_hidden_size=out, hidden_act="silu",
                    window_size=112, tokens_per_second=2,
                    fullatt_block_indexes=[i for i in range(common["depth"]) if (i + 1) % n_wa == 0])

    def save_processor(self, tmp: Path, mm, config, tokenizer, released: dict) -> None:
        """``preprocessor_config.json``: mean / std from the mmproj, the tower's patch geometry,
        the family's released pixel bounds ``released``."""
        from transformers import Qwen2VLImageProcessor

        v = config.vision_config
        Qwen2VLImageProcessor(image_mean=[f32(x) for x in field(mm, "clip.vision.image_mean")],
                              image_std=[f32(x) for x in field(mm, "clip.vision.image_std")],
                              min_pixels=released["min_pixels"], max_pixels=released["max_pixels"],
                              patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                              temporal_patch_size=2).save_pretrained(tmp)

    def vision_state_dict(self, mm, model_type: str, mmproj_path: Path) -> dict[str, torch.Tensor]:
        """The mmproj's tower as HF ``visual.*`` tensors without the prefix (fp32).

        Raises:
            ValueError: a tensor is missing, or one is left that the family does not use (named).
        """
        take = TensorTaker(mm, model_type, mmproj_path)
        out: dict[str, torch.Tensor] = {}
        halves = [take("v.patch_embd.weight"), take("v.patch_embd.weight.1")]  # [out, in, h, w] each
        out["patch_embed.proj.weight"] = torch.stack(halves, dim=2)  # HF Conv3D [out, in, t=2, h, w]
        if self.deepstack:  # Qwen3-VL: Conv3D bias and learned position table
            out["patch_embed.proj.bias"] = take("v.patch_embd.bias")
            out["pos_embed.weight"] = take("v.position_embd.weight")
        norm_kinds = ("weight",) if self.rms else ("weight", "bias")
        for i in range(int(field(mm, "clip.vision.block_count"))):
            for kind in ("weight", "bias"):
                if self.deepstack:
                    out[f"blocks.{i}.attn.qkv.{kind}"] = take(f"v.blk.{i}.attn_qkv.{kind}")
                else:
                    out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([take(f"v.blk.{i}.attn_{p}.{kind}") for p in "qkv"])
            for ours, hf in {**_BLOCK, **_MLP[self.mlp]}.items():
                for kind in norm_kinds if ours.startswith("ln") else ("weight", "bias"):
                    out[f"blocks.{i}.{hf}.{kind}"] = take(f"v.blk.{i}.{ours}.{kind}")
        for ours, hf in _MERGER[self.merger].items():
            for kind in norm_kinds if ours == "v.post_ln" else ("weight", "bias"):
                out[f"{hf}.{kind}"] = take(f"{ours}.{kind}")
        if self.deepstack:  # v.deepstack.<tower block> -> deepstack_merger_list.<k-th tap>
            taps = [i for i, f in enumerate(field(mm, "clip.vision.is_deepstack_layers", [])) if f]
            for k, block in enumerate(taps):
                for ours, hf in _DEEPSTACK.items():
                    for kind in ("weight", "bias"):
                        out[f"deepstack_merger_list.{k}.{hf}.{kind}"] = take(f"v.deepstack.{block}.{ours}.{kind}")
        take.check_all_used()
        return out


QWEN2_VL = QwenVLPair(mlp="fc", rms=False, merger="mlp", deepstack=False)
QWEN2_5_VL = QwenVLPair(mlp="gated", rms=True, merger="mlp", deepstack=False)
QWEN3_VL = QwenVLPair(mlp="linear_fc", rms=False, merger="linear_fc", deepstack=True)
