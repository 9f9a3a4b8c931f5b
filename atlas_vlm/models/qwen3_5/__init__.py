"""Qwen3.5 (HF ``qwen3_5``): hybrid Gated DeltaNet / full-attention decoder, vision tower, media inputs."""
