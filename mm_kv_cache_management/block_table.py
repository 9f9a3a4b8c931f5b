"""One request's blocks, in order, and the token -> slot rule."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockTable:
    """The KV blocks of one request, in token order.

    Token ``pos`` (0-based, in tokens) lives in block ``block_ids[pos // block_size]`` at
    offset ``pos % block_size``; its flat *slot* in the cache is
    ``block_ids[pos // block_size] * block_size + pos % block_size`` (vLLM's slot mapping).
    """

    block_size: int  # tokens per block
    block_ids: list[int] = field(default_factory=list)  # cache block ids, in token order
    num_tokens: int = 0  # tokens whose K/V are stored (or scheduled to be) in these blocks

    @property
    def capacity(self) -> int:
        """Tokens the held blocks can store."""
        return len(self.block_ids) * self.block_size

    def slot(self, pos: int) -> int:
        """Flat cache slot of token ``pos``.

        Raises:
            IndexError: ``pos`` is negative or past the reserved blocks.
        """
        if not 0 <= pos < self.capacity:
            raise IndexError(
                f"token position {pos} is outside the {self.capacity} slots reserved "
                f"({len(self.block_ids)} blocks of {self.block_size})"
            )
        return self.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Flat slots of tokens ``start .. end-1`` (the slot mapping of a chunk)."""
        return [self.slot(pos) for pos in range(start, end)]
