"""Qwen2-VL and Qwen2.5-VL: the vision tower (``vision``: HF's tower, ``vision_fast``: our
forward of its weights), the media inputs (``inputs``) and the family hooks (``family``).
The Qwen-VL pieces the Qwen families share live here too: the image and video processors
(``image_processor``, ``video_processor``: HF ``Qwen2VLImageProcessor`` /
``Qwen2VLVideoProcessor`` patchify), the prompt ids with expanded placeholders and the
Qwen2.5-VL default chat template (``prompt_ids``), and the tokenizer files (``tokenizer_files``).
The language model is the shared decoder (``atlas_vlm.models.decoder``) with M-RoPE.
"""
