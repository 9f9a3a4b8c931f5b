"""Exact speculative decoding (docs/speculative.md): the n-gram draft proposer (``ngram``),
the scheduler's drafting and verification steps (``scheduling``) and speculative sampling for
``temperature > 0`` (``rejection``)."""

from atlas_vlm.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "placeholder_token_ids"]


def placeholder_token_ids(hf_config) -> set[int]:
    """The media placeholder token ids of ``hf_config`` (``image_token_id`` /
    ``video_token_id`` where set): tokens no drafter ever proposes or matches."""
    ids = (getattr(hf_config, name, None) for name in ("image_token_id", "video_token_id"))
    return {t for t in ids if isinstance(t, int)}
