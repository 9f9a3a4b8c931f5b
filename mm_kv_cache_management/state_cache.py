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

Speculative decoding (``atlas_vlm.spec_decode``) verifies ``k`` draft tokens in one step: the
sequence's ``k + 1`` rows advance its state past drafts that may be rejected. The layers keep
the state after each of the first ``k`` rows (``StateMetadata.num_drafts``,
``StateCache.keep_row``: vLLM's per-token states of its Mamba layers); once the sampler knows
how many rows were taken, ``StateCache.accept_rows`` puts the slot at the state after the
last of them (the slot itself holds the state after all ``k + 1``).
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
        # slot -> (conv [num_layers, k, *conv_shape], recurrent [num_layers, k, *recurrent_shape]):
        # the state after each of the first k rows of the slot's verification step
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

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
        self._rows.pop(slot, None)

    def reset(self, slot: int) -> None:
        """Zero ``slot``'s state in every layer (a sequence that starts over)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        self._rows.pop(slot, None)

    def keep_row(self, layer: int, slot: int, row: int, num_drafts: int) -> None:
        """Keep ``slot``'s current state of ``layer`` as its state after row ``row`` of a
        verification step with ``num_drafts`` drafts (called by the layer after each row
        ``0 .. num_drafts - 1``; the buffer is made on first use).

        Raises:
            ValueError: ``row`` not in ``0 .. num_drafts - 1`` or ``layer`` / ``slot`` out of range.
        """
        if not 0 <= row < num_drafts or not 0 <= layer < self.spec.num_layers or not 0 <= slot < self.num_slots:
            raise ValueError(f"keep_row: row {row} of {num_drafts} drafts, layer {layer} of {self.spec.num_layers}, "
                             f"slot {slot} of {self.num_slots} out of range")
        rows = self._rows.get(slot)
        if rows is None or rows[0].shape[1] != num_drafts:
            rows = (self.conv.new_empty(self.spec.num_layers, num_drafts, *self.spec.conv_shape),
                    self.recurrent.new_empty(self.spec.num_layers, num_drafts, *self.spec.recurrent_shape))
            self._rows[slot] = rows
        rows[0][layer, row].copy_(self.conv[layer, slot])
        rows[1][layer, row].copy_(self.recurrent[layer, slot])

    def accept_rows(self, slot: int, num_rows: int) -> None:
        """After a verification step of ``slot``: ``num_rows`` of its ``k + 1`` rows were taken
        (its last sampled token and ``num_rows - 1`` accepted drafts); the slot's state becomes
        the state after row ``num_rows - 1`` (every layer) and the kept rows are dropped.

        Raises:
            ValueError: no rows kept for ``slot`` (its layers did not keep them), or ``num_rows``
                not in ``1 .. k + 1``.
        """
        rows = self._rows.pop(slot, None)
        if rows is None:
            raise ValueError(f"state slot {slot} kept no verification rows; its model cannot roll back drafts")
        k = rows[0].shape[1]
        if not 1 <= num_rows <= k + 1:
            raise ValueError(f"accept_rows: num_rows must be in 1..{k + 1} for {k} drafts, got {num_rows}")
        if num_rows <= k:  # some drafts rejected: back to the state after the last taken row
            self.conv[:, slot].copy_(rows[0][:, num_rows - 1])
            self.recurrent[:, slot].copy_(rows[1][:, num_rows - 1])


@dataclass
class StateMetadata:
    """One step's view of the state cache, in the order of the step's sequences.

    ``slots[i]`` is the slot sequence ``i`` reads and writes; ``has_initial_state[i]`` is False
    when sequence ``i`` starts at token 0 this step (its state is taken as zero, whatever the
    slot holds), True when it continues from the state its previous step left in the slot.

    ``num_drafts[i]`` > 0: sequence ``i``'s rows this step are its last sampled token and that
    many drafts (a verification step): its layers keep the state after each row but the last
    (``StateCache.keep_row``) for ``accept_rows``; None / 0: a plain chunk.

    ``snapshots[i]``: ``[(k, snapshot slot)]``: after its ``k``-th new token of the step, sequence
    ``i``'s state (every layer) is also written to that slot of ``snapshot_cache`` (prefix
    caching of hybrid models, ``state_snapshots.py``); empty / None: no snapshot.
    """

    cache: StateCache
    slots: torch.Tensor  # [num_seqs] int64
    has_initial_state: torch.Tensor  # [num_seqs] bool
    snapshots: list[list[tuple[int, int]]] | None = None  # per sequence, k ascending
    snapshot_cache: StateCache | None = None  # StateSnapshotPool.storage
    num_drafts: list[int] | None = None  # per sequence: drafts verified this step (0: none)
