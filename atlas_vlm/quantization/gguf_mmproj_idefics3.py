"""llama.cpp's ``idefics3`` projector (SmolVLM / SmolVLM2) of a VLM GGUF pair: the SigLIP tower
+ pixel-shuffle connector turned back into HF's ``vision_config``, ``SmolVLMProcessor`` and
tensors.

Source: llama.cpp's ``conversion/smolvlm.py`` (``clip.projector_type`` ``idefics3``;
``clip.vision.projector.scale_factor`` the pixel shuffle; ``clip.vision.preproc_image_size``
the processor's ``size.longest_edge``; ``clip.vision.image_size`` the tile side, HF's
``max_image_size.longest_edge``; ``clip.vision.attention.layer_norm_epsilon`` the tower's
``layer_norm_eps``) and ``gguf-py/gguf/tensor_mapping.py`` (``v.patch_embd`` / ``v.position_embd``
/ ``v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,ffn_down}`` / ``v.post_ln``;
``mm.model.fc`` the connector's ``modality_projection.proj``). The decoder is written as
llama.cpp's ``llama`` architecture (Q/K rows permuted; ``text_state_dict`` undoes that).

``image_seq_len`` is derived as llama.cpp's clip does: ``(image_size // patch_size)**2 //
scale_factor**2``. Video sampling is not in the mmproj (llama.cpp has no SmolVLM video): the
pair gets SmolVLM2's released ``video_sampling`` (``fps`` 1, ``max_frames`` 64) with frames
of the image processor's longest edge.
"""

from __future__ import annotations

from pathlib import Path

import torch

from atlas_vlm.quantization.gguf_mmproj_names import TensorTaker, f32, field

__all__ = ["Idefics3Pair", "IDEFICS3"]

_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
          "ffn_down": "mlp.fc2"}
#: SmolVLM2's released ``video_sampling`` (fps, max_frames)
RELEASED_VIDEO_SAMPLING = {"fps": 1, "max_frames": 64}


class Idefics3Pair:
    """The ``idefics3`` projector: image token ``<image>``, a Llama decoder."""

    special_tokens = {"image_token_id": "<image>"}

    def text_config(self, model, arch: str, text: dict) -> dict:
        """``text`` as a Llama ``text_config`` (no M-RoPE)."""
        return dict(text, model_type="llama")

    def vision_config(self, mm) -> dict:
        """HF ``SmolVLMVisionConfig`` fields from the ``clip.vision.*`` keys (``top_config``
        gives the top-level ``scale_factor``)."""
        return dict(hidden_size=int(field(mm, "clip.vision.embedding_length")),
                    intermediate_size=int(field(mm, "clip.vision.feed_forward_length")),
                    num_hidden_layers=int(field(mm, "clip.vision.block_count")),
                    num_attention_heads=int(field(mm, "clip.vision.attention.head_count")),
                    image_size=int(field(mm, "clip.vision.image_size")),
                    patch_size=int(field(mm, "clip.vision.patch_size")),
                    layer_norm_eps=f32(field(mm, "clip.vision.attention.layer_norm_epsilon", 1e-6)))

    def top_config(self, mm) -> dict:
        """Top-level config fields: the connector's pixel-shuffle ``scale_factor``."""
        return dict(scale_factor=int(field(mm, "clip.vision.projector.scale_factor", 2)))

    def save_processor(self, tmp: Path, mm, config, tokenizer, released: dict | None) -> None:
        """``SmolVLMProcessor`` (image + video processors, ``image_seq_len``, the model GGUF's
        chat template) saved to ``tmp``, and the image processor alone as
        ``preprocessor_config.json``. ``released`` is unused (the family states no defaults:
        the mmproj holds every image setting).

        Raises:
            ValueError: the tile is not a whole number of patches, or ``image_seq_len`` would be 0.
        """
        from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

        v = config.vision_config
        tile = v.image_size
        longest = int(field(mm, "clip.vision.preproc_image_size", 4 * tile))
        per_side = tile // v.patch_size
        seq_len = per_side * per_side // config.scale_factor**2
        if tile % v.patch_size or seq_len == 0:
            raise ValueError(f"mmproj: image_size {tile}, patch_size {v.patch_size} and scale_factor "
                             f"{config.scale_factor} give no whole visual-token grid")
        mean = [f32(x) for x in field(mm, "clip.vision.image_mean")]
        std = [f32(x) for x in field(mm, "clip.vision.image_std")]
        image = SmolVLMImageProcessor(size={"longest_edge": longest}, max_image_size={"longest_edge": tile},
                                      image_mean=mean, image_std=std)
        video = SmolVLMVideoProcessor(video_sampling={**RELEASED_VIDEO_SAMPLING, "video_size": {"longest_edge": longest}},
                                      max_image_size={"longest_edge": tile}, image_mean=mean, image_std=std)
        image.save_pretrained(tmp)  # preprocessor_config.json: what FamilyHooks.image_processor_settings reads
        SmolVLMProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video, image_seq_len=seq_len,
                         chat_template=tokenizer.chat_template).save_pretrained(tmp)

    def vision_state_dict(self, mm, model_type: str, mmproj_path: Path) -> dict[str, torch.Tensor]:
        """The tower (``vision_model.*``) and connector (``connector.*``) as HF tensors (fp32).

        Raises:
            ValueError: a tensor is missing, or one is left that SmolVLM does not use (named).
        """
        take = TensorTaker(mm, model_type, mmproj_path)
        out = {"vision_model.embeddings.patch_embedding.weight": take("v.patch_embd.weight"),
               "vision_model.embeddings.patch_embedding.bias": take("v.patch_embd.bias"),
               "vision_model.embeddings.position_embedding.weight": take("v.position_embd.weight"),
               "vision_model.post_layernorm.weight": take("v.post_ln.weight"),
               "vision_model.post_layernorm.bias": take("v.post_ln.bias"),
               "connector.modality_projection.proj.weight": take("mm.model.fc.weight")}
        for i in range(int(field(mm, "clip.vision.block_count"))):
            for ours, hf in _LAYER.items():
                for kind in ("weight", "bias"):
                    out[f"vision_model.encoder.layers.{i}.{hf}.{kind}"] = take(f"v.blk.{i}.{ours}.{kind}")
        take.check_all_used()
        return out


IDEFICS3 = Idefics3Pair()
