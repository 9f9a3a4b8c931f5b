"""Decoder models whose attention runs over KV blocks."""

from atlas_vlm.models.arch import ModelArch
from atlas_vlm.models.decoder import CausalLM

__all__ = ["CausalLM", "ModelArch"]
