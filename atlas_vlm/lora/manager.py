"""``LoRAModelManager``: the engine's adapters (vLLM's ``vllm/lora/models.LoRAModelManager``).

Scope: wraps the decoder's q/k/v/o/gate/up/down projections in ``LoRALinear`` (fused
``qkv_proj`` / ``gate_up_proj`` included), keeps the registry of adapters read from disk (by
name; checked at load, ``peft_adapter``), puts them into ``max_loras`` fixed slots on
demand (an idle adapter leaves its slot to a new one, least recently used first), and sets
each step's per-row slots (``PunicaBatch``). Thread-safety: ``register`` / ``remove`` may
run on any thread (one lock); ``activate`` and ``set_step`` run under the engine's lock,
so no slot is rewritten while a step reads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from atlas_vlm.lora.layers import LoRALinear, PunicaBatch
from atlas_vlm.lora.peft_adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from atlas_vlm.lora.request import LoRARequest

#: our fused module -> (its parent: "self_attn" / "mlp", the HF projections fused in it, in row order)
FUSED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
         "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def lora_memory_bytes(shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int, max_rank: int,
                      dtype_bytes: int) -> int:
    """Bytes of the adapter slots: ``max_loras x max_rank x sum(in + out) over the target
    modules x layers x dtype bytes`` (``shapes``: ``{hf_module: (in, out)}``)."""
    return max_loras * max_rank * sum(i + o for i, o in shapes.values()) * num_layers * dtype_bytes


def projection_shapes(hidden: int, q_size: int, kv_size: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """``{hf_module: (in_features, out_features)}`` of one decoder layer's projections."""
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}


class LoRAModelManager:
    """Adapters of one model, in ``max_loras`` slots of rank ``max_lora_rank``.

    Args:
        model: the decoder (``CausalLM``: ``model.layers[i].self_attn`` / ``.mlp``).
        max_loras, max_lora_rank: slots and padded rank (``LoRAConfig``).
        qkv_sizes: rows of q, k, v in ``qkv_proj`` (``ModelCapabilities.qkv_sizes``; None: from the arch).
    """

    def __init__(self, model, max_loras: int, max_lora_rank: int, qkv_sizes=None):
        arch, self.max_loras, self.max_rank = model.arch, max_loras, max_lora_rank
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        sizes = list(qkv_sizes) if qkv_sizes else [q, kv, kv]
        self.shapes = projection_shapes(arch.hidden_size, sizes[0], sizes[1], arch.intermediate_size)
        self.num_layers, self.punica = arch.num_layers, PunicaBatch(max_loras)
        p = next(model.parameters())
        self.dtype = p.dtype
        self.layers: list[dict[str, LoRALinear]] = []
        for layer in model.model.layers:
            wrapped = {}
            for ours, (parent, hf_names) in FUSED.items():
                owner = getattr(layer, parent)
                wrapped[ours] = LoRALinear(getattr(owner, ours), [self.shapes[h][1] for h in hf_names], max_loras,
                                           max_lora_rank, self.punica, p.dtype, p.device)
                setattr(owner, ours, wrapped[ours])
            self.layers.append(wrapped)
        self.memory_bytes = lora_memory_bytes(self.shapes, self.num_layers, max_loras, max_lora_rank, p.element_size())
        self._lock = threading.Lock()
        self.adapters: dict[str, tuple[LoRARequest, LoRAAdapter]] = {}  # name -> registered adapter
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first

    def register(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check ``request``'s adapter once (later calls reuse it); nothing changes on a refusal.

        Raises:
            LoRAAdapterError: the adapter does not fit (rank, shapes, target modules), or its
                name / id is taken by another adapter.
        """
        with self._lock:
            known = self.adapters.get(request.lora_name)
            if known is not None:
                if (known[0].lora_int_id, known[0].lora_path) != (request.lora_int_id, request.lora_path):
                    raise LoRAAdapterError(f"LoRA adapter name {request.lora_name!r} is already loaded with id "
                                           f"{known[0].lora_int_id} from {known[0].lora_path}")
                return known[1]
            if any(r.lora_int_id == request.lora_int_id for r, _ in self.adapters.values()):
                raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is already used by another adapter")
        adapter = load_peft_adapter(request.lora_name, request.lora_path, self.shapes, self.num_layers, self.max_rank)
        with self._lock:
            self.adapters.setdefault(request.lora_name, (request, adapter))
            return self.adapters[request.lora_name][1]

    def remove(self, name: str, busy_ids: set[int] = frozenset()) -> bool:
        """Forget adapter ``name`` (its slot is reused later); False: not registered.

        Raises:
            LoRAAdapterError: requests with that adapter are in flight (``busy_ids``).
        """
        with self._lock:
            entry = self.adapters.get(name)
            if entry is None:
                return False
            if entry[0].lora_int_id in busy_ids:
                raise LoRAAdapterError(f"LoRA adapter {name!r} has requests in flight; unload it once they finish")
            del self.adapters[name]
            self.slots.pop(entry[0].lora_int_id, None)
            return True

    def names(self) -> list[str]:
        """Registered adapter names, in load order."""
        with self._lock:
            return list(self.adapters)

    def activate(self, request: LoRARequest, busy_ids: set[int]) -> int:
        """The slot of ``request``'s adapter, writing it into a free slot (or the least
        recently used one of an adapter with no request in ``busy_ids``) if not resident.

        Raises:
            LoRAAdapterError: the adapter is not registered, or every slot holds an adapter
                with requests in flight.
        """
        with self._lock:
            entry = self.adapters.get(request.lora_name)
        if entry is None:
            raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} is not loaded")
        rid = request.lora_int_id
        if rid in self.slots:
            self.slots.move_to_end(rid)
            return self.slots[rid]
        free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
        if not free:
            idle = next((i for i in self.slots if i not in busy_ids), None)
            if idle is None:
                raise LoRAAdapterError(f"all max_loras={self.max_loras} LoRA slots hold adapters with requests in "
                                       f"flight; {request.lora_name!r} must wait, or raise max_loras")
            free = [self.slots.pop(idle)]
        slot, adapter = free[0], entry[1]
        for i, wrapped in enumerate(self.layers):
            for ours, (_, hf_names) in FUSED.items():
                wrapped[ours].set_slot(slot, [adapter.weights.get((i, h)) for h in hf_names], adapter.scaling)
        self.slots[rid] = slot
        return slot

    def set_step(self, chunks, device: torch.device | str) -> list[int]:
        """Per-token slots of one step's chunks (``[(request, num_tokens)]``; -1: no adapter),
        grouped into the ``PunicaBatch`` every wrapped layer reads; returns them."""
        token_slots: list[int] = []
        for req, n in chunks:
            lora = getattr(req, "lora_request", None)
            token_slots.extend([self.slots[lora.lora_int_id] if lora is not None else -1] * n)
        self.punica.set(token_slots, device, self.dtype)
        return token_slots


def attach_lora(manager: LoRAModelManager | None, req, lora_request: LoRARequest | None) -> None:
    """Give ``req`` its adapter: ``req.lora_request`` and ``req.cache_salt`` (the adapter's
    fingerprint: the prefix cache never shares blocks across adapters); the adapter is read
    and checked now if new (``LoRAModelManager.register``).

    Raises:
        TypeError: ``lora_request`` is not a ``LoRARequest``.
        ValueError: LoRA is off (``enable_lora=False``), or the adapter is refused (``LoRAAdapterError``).
    """
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
    if manager is None:
        raise ValueError(f"lora_request {lora_request.lora_name!r} given, but this engine serves no adapters; "
                         "start it with enable_lora=True (--enable-lora)")
    adapter = manager.register(lora_request)
    req.lora_request, req.cache_salt = lora_request, f"lora:{adapter.fingerprint}"
