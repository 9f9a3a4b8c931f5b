"""Exact speculative decoding (docs/speculative.md): the n-gram draft proposer (``ngram``),
the scheduler's drafting and verification steps (``scheduling``) and speculative sampling for
``temperature > 0`` (``rejection``)."""

from atlas_vlm.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
