"""Chained content hashes of full KV blocks, for prefix caching.

A block's hash covers its parent block's hash, its token ids and, for every media item
(image, video) whose placeholder run overlaps the block, the item's content hash and the
offset of the block's first token in the item's encoder rows. Placeholder tokens share one
id, so without that key two different images would map to the same K/V (handed case C12).
A request's ``cache_salt`` (an opaque string: the engine puts its LoRA adapter's fingerprint
there, vLLM's ``lora_request`` extra key / ``cache_salt``) goes into its first block, and so,
through the chain, into every block: requests with different salts never share a block, in
memory or in the disk tier (whose files are named by these hashes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def block_hash(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[tuple[str, int]] = (),
    cache_salt: str | None = None,
) -> bytes:
    """Hash of one full block (blake2b, 16 bytes).

    Args:
        parent_hash: hash of the previous block of the same request, ``None`` for block 0.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: ``(item content hash, offset of this block's first token in the item's
            encoder rows)`` for each placeholder range the block overlaps.
        cache_salt: an opaque key of the request (its LoRA adapter), hashed into block 0 only
            (``parent_hash`` None); later blocks carry it through their parent's hash.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"root")
    if parent_hash is None and cache_salt is not None:
        h.update(f"|salt:{cache_salt}|".encode())
    h.update(b",".join(str(t).encode() for t in token_ids))
    for content_hash, offset in extra_keys:
        h.update(f"|img:{content_hash}@{offset}".encode())
    return h.digest()
