"""Qwen3-VL: the decoder with DeepStack injection (``model``), the vision tower and chat
template (``vision``), the media inputs (``inputs``) and the family hooks (``family``).
"""
