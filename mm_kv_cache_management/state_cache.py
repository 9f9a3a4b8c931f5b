"""Per-sequence recurrent state of linear-attention layers (Gated DeltaNet): the second KV-cache
group of a hybrid model, beside the paged K/V of its full-attention layers.

A hybrid model (Qwen3.5: three of every four decoder layers are Gated DeltaNet) keeps, per
running sequence and per linear-attention layer, a causal-conv1d state and a recurrent state
whose size does not depend on the sequence's length. ``StateCache`` holds them for
``num_slots`` sequences in fp32 (vLLM v1's ``MambaSpec`` group); a running sequence owns one
slot from admission to finish, abort or preemption (a preempted sequence drops its state and
recomputes it from token 0).

``StateMetadata`` is what one step's forward needs: which slot each sequence of the step
reads and writes, and whether it starts from a zero state (its first chunk) or carries the
state left by its previous chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The state's dtype whatever the model's (HF keeps the recurrent state in fp32 too).
STATE_DTYPE = torch.float32


class NoFreeStateSlotsError(RuntimeError):
    """Every state slot is held by a running sequence."""


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Shape of the state one sequence keeps in every linear-attention layer.

    ``conv``: ``[conv_dim, conv_kernel - 1]`` (the last ``kernel - 1`` inputs of the causal
    conv1d); ``recurrent``: ``[num_v_heads, k_head_dim, v_head_dim]``. Both fp32.
    """

    num_layers: int  # linear-attention layers
    conv_dim: int  # channels into the causal conv1d (2 * key_dim + value_dim for Gated DeltaNet)
    conv_kernel: int  # linear_conv_kernel_dim
    num_v_heads: int  # linear_num_value_heads
    k_head_dim: int  # linear_key_head_dim
    v_head_dim: int  # linear_value_head_dim

    def __post_init__(self) -> None:
        for name in ("num_layers", "conv_dim", "conv_kernel", "num_v_heads", "k_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"StateSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    @property
    def bytes_per_seq(self) -> int:
        """Bytes of one sequence's state across all linear-attention layers (independent of length)."""
        conv = self.conv_shape[0] * self.conv_shape[1]
        rec = self.num_v_heads * self.k_head_dim * self.v_head_dim
        return self.num_layers * (conv + rec) * STATE_DTYPE.itemsize


class StateCache:
    """State slots for ``num_slots`` sequences.

    ``conv``: ``[num_layers, num_slots, conv_dim, conv_kernel - 1]``; ``recurrent``:
    ``[num_layers, num_slots, num_v_heads, k_head_dim, v_head_dim]``; both fp32 and zero at
    allocation. Slots are handed out lowest first; a slot is zeroed when allocated.
    """

    def __init__(self, spec: StateSpec, num_slots: int, device="cpu"):
        if num_slots < 1:
            raise ValueError(f"the state cache needs at least one slot ({spec.bytes_per_seq} bytes); got {num_slots}")
        self.spec, self.num_slots = spec, num_slots
        self.conv = torch.zeros(spec.num_layers, num_slots, *spec.conv_shape, dtype=STATE_DTYPE, device=device)
        self.recurrent = torch.zeros(spec.num_layers, num_slots, *spec.recurrent_shape, dtype=STATE_DTYPE,
                                     device=device)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, zeroed. Raises ``NoFreeStateSlotsError`` when none is free."""
        if not self._free:
            raise NoFreeStateSlotsError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Raises ``ValueError`` for a slot out of range or already free."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not an allocated slot of {self.num_slots}")
        self._free.append(slot)
        self._free.sort(reverse=True)

    def reset(self, slot: int) -> None:
        """Zero ``slot``'s state in every layer (a sequence that starts over)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()


@dataclass
class StateMetadata:
    """One step's view of the state cache, in the order of the step's sequences.

    ``slots[i]`` is the slot sequence ``i`` reads and writes; ``has_initial_state[i]`` is False
    when sequence ``i`` starts at token 0 this step (its state is taken as zero, whatever the
    slot holds), True when it continues from the state its previous step left in the slot.

    ``snapshots[i]``: ``[(k, snapshot slot)]``: after its ``k``-th new token of the step, sequence
    ``i``'s state (every layer) is also written to that slot of ``snapshot_cache`` (prefix
    caching of hybrid models, ``state_snapshots.py``); empty / None: no snapshot.
    """

    cache: StateCache
    slots: torch.Tensor  # [num_seqs] int64
    has_initial_state: torch.Tensor  # [num_seqs] bool
    snapshots: list[list[tuple[int, int]]] | None = None  # per sequence, k ascending
    snapshot_cache: StateCache | None = None  # StateSnapshotPool.storage
