"""Qwen3.5 (HF ``qwen3_5``): the hybrid decoder (Gated DeltaNet + gated full attention,
``model.py``, ``gated_deltanet.py``), its vision tower (``vision.py``: Qwen3-VL's without
DeepStack) and size counts (``param_count.py``)."""

from atlas_vlm.models.qwen3_5.model import Qwen3_5ForCausalLM

__all__ = ["Qwen3_5ForCausalLM"]
