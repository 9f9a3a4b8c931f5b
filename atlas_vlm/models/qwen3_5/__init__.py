"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention): the language model.

The vision side is built elsewhere (``mm_token_pipeline``); until it lands the family is
registered text-only (``multimodal=False``).
"""

from atlas_vlm.models.qwen3_5.model import Qwen3_5ForCausalLM

__all__ = ["Qwen3_5ForCausalLM"]
