"""Exact speculative decoding: draft proposers (``ngram``) and the verification rule (``verify``)."""

from atlas_vlm.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
