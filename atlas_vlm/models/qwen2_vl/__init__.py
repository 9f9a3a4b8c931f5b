"""Qwen2-VL and Qwen2.5-VL: the vision tower (``vision``: HF's tower, ``vision_fast``: our
forward of its weights), the media inputs (``inputs``) and the family hooks (``family``).
The language model is the shared decoder (``atlas_vlm.models.decoder``) with M-RoPE.
"""
