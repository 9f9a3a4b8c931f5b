"""Which engine replica gets a request: cache-aware routing over N replicas (no Ray here).

Routing key. The ingress holds no tokenizer or model, so the key is computed on the prompt
as the client sent it, not on token ids: the prompt's text (a completion string, or each
chat message as ``role`` + its text parts, an image part as ``<img:DIGEST>``) is cut into
fixed ``key_block_bytes``-byte blocks of UTF-8, and the leading full blocks are chained
with the same ``mm_kv_cache_management.block_hash`` the ``BlockManager`` uses (a token-id
prompt is chained on its ids in blocks of ``key_block_tokens``). Two prompts that share
the first k key blocks share a text prefix of ``k * key_block_bytes`` bytes, hence (the
tokenizer is deterministic and the chat template is applied per message) most of their
leading KV blocks. Images are keyed by a digest of their URL / data string, which is what
makes the engine's ``content_hash`` equal when the same image is sent again. This avoids a
second tokenizer + chat template + image processor in the ingress (seconds of start-up and
memory per ingress) for a key that only has to be stable, not exact.

Policy (SGLang's cache-aware router and vLLM production stack's prefix-aware routing
follow the same idea): find the replica recorded for the deepest known prefix block (else
for one of the request's images); take it unless it has more than
``imbalance_threshold`` requests in flight above the least-loaded live replica, then fall
back to the least-loaded one. The map prefix hash -> replica is an LRU bounded by
``max_entries``. ``least_loaded`` is the baseline: the live replica with the fewest
requests in flight (ties: lowest index).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from mm_kv_cache_management.hashing import block_hash

POLICIES = ("cache_aware", "least_loaded")


def _digest(source) -> str:
    """A stable digest of an image source: str (URL, path, data URL), bytes, or a PIL image."""
    if hasattr(source, "tobytes"):  # PIL image: its pixels and size
        data = repr((getattr(source, "size", None), getattr(source, "mode", None))).encode() + source.tobytes()
    elif isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        data = str(source).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _chat_text(messages: list) -> tuple[str, list[str]]:
    parts, images = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        parts.append(f"<{m.get('role', '') if isinstance(m, dict) else ''}>")
        if isinstance(content, str):
            parts.append(content)
            continue
        for part in content or []:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:  # an image part: its URL / path / data string (or the object's repr)
                ref = part.get("image_url") or part.get("image") or part
                ref = ref.get("url", ref) if isinstance(ref, dict) else ref
                d = _digest(ref)
                images.append(d)
                parts.append(f"<img:{d}>")
    return "".join(parts), images


def routing_keys(prompt, key_block_bytes: int = 64, key_block_tokens: int = 16,
                 max_blocks: int = 64) -> tuple[list[bytes], list[str]]:
    """Chained hashes of the prompt's leading full key blocks, and its image digests.

    Args:
        prompt: an engine prompt (str, ``{"prompt_token_ids": [...]}``, or a chat prompt
            ``{"messages": [...]}`` as the OpenAI routes build it).
        max_blocks: hash at most this many leading blocks.

    Returns:
        (block hashes in prompt order, image digests in prompt order); both may be empty.
    """
    images: list[str] = []
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        seq, size = list(prompt["prompt_token_ids"]), key_block_tokens
    else:
        if isinstance(prompt, dict) and "messages" in prompt:
            text, images = _chat_text(prompt["messages"])
        else:
            text = prompt if isinstance(prompt, str) else str(prompt.get("prompt", "")) if isinstance(prompt, dict) else ""
        seq, size = list(text.encode()), key_block_bytes
    hashes, parent = [], None
    for start in range(0, min(len(seq) // size, max_blocks) * size, size):
        parent = block_hash(parent, seq[start:start + size])
        hashes.append(parent)
    return hashes, images


class ReplicaRouter:
    """Chooses a replica index per request and counts requests in flight per replica.

    Args:
        num_replicas: N >= 1.
        policy: ``"cache_aware"`` or ``"least_loaded"``.
        imbalance_threshold: cache-aware only; leave the cached replica when it has more
            than this many requests in flight above the least-loaded live one.
        max_entries: LRU bound of the prefix/image hash -> replica map.

    Raises:
        ValueError: ``num_replicas < 1``, unknown ``policy``, negative threshold.
    """

    def __init__(self, num_replicas: int, policy: str = "cache_aware", imbalance_threshold: int = 4,
                 max_entries: int = 65536):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {POLICIES}")
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
        self.num_replicas, self.policy = num_replicas, policy
        self.imbalance_threshold, self.max_entries = imbalance_threshold, max_entries
        self.in_flight = [0] * num_replicas
        self.alive = [True] * num_replicas
        self.owner: OrderedDict = OrderedDict()  # prefix hash / image digest -> replica index
        self.decisions = {"cache_hit": 0, "load_balance": 0, "no_key": 0}

    def least_loaded(self) -> int:
        live = [i for i in range(self.num_replicas) if self.alive[i]] or list(range(self.num_replicas))
        return min(live, key=lambda i: (self.in_flight[i], i))

    def choose(self, hashes: list[bytes], images: list[str]) -> int:
        """The replica for a request with these routing keys; records the keys as owned by it."""
        best = self.least_loaded()
        choice, reason = best, "no_key"
        if self.policy == "cache_aware":
            cached = next((self.owner[h] for h in reversed(hashes) if h in self.owner), None)
            if cached is None:
                cached = next((self.owner[d] for d in images if d in self.owner), None)
            if cached is not None and self.alive[cached] and \
                    self.in_flight[cached] - self.in_flight[best] <= self.imbalance_threshold:
                choice, reason = cached, "cache_hit"
            elif cached is not None:
                reason = "load_balance"
            for key in [*hashes, *images]:
                self.owner[key] = choice
                self.owner.move_to_end(key)
            while len(self.owner) > self.max_entries:
                self.owner.popitem(last=False)
        self.decisions[reason] += 1
        return choice

    def started(self, i: int) -> None:
        self.in_flight[i] += 1

    def finished(self, i: int) -> None:
        self.in_flight[i] -= 1

    def mark(self, i: int, alive: bool) -> None:
        """A replica failed (``False``: no new requests) or answered again (``True``)."""
        self.alive[i] = alive
        if not alive:
            for key in [k for k, v in self.owner.items() if v == i]:  # its caches are gone with it
                del self.owner[key]
