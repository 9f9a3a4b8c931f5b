"""Read and check one PEFT LoRA adapter folder against the loaded model (``peft``'s format:
``adapter_config.json`` + ``adapter_model.safetensors`` as ``save_pretrained`` writes them).

Scope: ``load_peft_adapter`` -> ``LoRAAdapter`` (per layer and HF projection, A ``[r, in]``
and B ``[out, r]``; the scaling; a content fingerprint). Every refusal is a
``LoRAAdapterError`` naming the adapter and the reason: a rank above ``max_lora_rank``, a
target module the engine does not wrap (embeddings, ``lm_head``, the vision tower),
shapes that do not fit the base (another model's adapter), DoRA, ``modules_to_save``, a
bias, per-module rank / alpha patterns. Nothing here touches the engine: a refused adapter
changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

#: the HF projections of the language model an adapter may target (vLLM's supported_lora_modules)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>[a-z_]+)"
                  r"\.lora_(?P<ab>[AB])\.weight$")
_VISION = ("visual", "vision", "vit")


class LoRAAdapterError(ValueError):
    """An adapter that does not fit this engine (the message names it and why)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights, checked against the model.

    Attributes:
        name, path: from its ``LoRARequest``.
        rank: the largest rank of its modules; ``scaling``: ``lora_alpha / r`` (rsLoRA:
            ``lora_alpha / sqrt(r)``, peft's ``use_rslora``).
        weights: ``{(layer, hf_module): (A [r, in], B [out, r])}`` (fp32, CPU).
        fingerprint: blake2b of the config and weights bytes (the prefix-cache key).
    """

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str


def _refuse(name: str, why: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {name!r} refused: {why}")


def _check_config(name: str, cfg: dict, max_rank: int) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full copies of modules)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if cfg.get(key):
            raise _refuse(name, f"{why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, f"bias={cfg['bias']!r} is not supported (only 'none')")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise _refuse(name, f"adapter_config.json r must be an int >= 1, got {r!r}")
    if r > max_rank:
        raise _refuse(name, f"rank r={r} is above max_lora_rank={max_rank}; start the engine with "
                            f"max_lora_rank >= {r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise _refuse(name, f"target modules {unknown} are not supported; LoRA applies to the language "
                                f"model's {list(TARGET_MODULES)}")


def load_peft_adapter(name: str, path: str, shapes: dict[str, tuple[int, int]], num_layers: int,
                      max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter in folder ``path``.

    Args:
        shapes: ``{hf_module: (in_features, out_features)}`` of the base's projections.
        num_layers: the decoder's layers; ``max_rank``: the engine's ``max_lora_rank``.

    Raises:
        LoRAAdapterError: a missing or unreadable folder, or an adapter that does not fit
            (the message names the adapter and the reason).
    """
    folder = Path(path)
    cfg_path, st_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file() or not st_path.is_file():
        raise _refuse(name, f"{folder} has no adapter_config.json + adapter_model.safetensors (peft's format)")
    raw_cfg, raw_st = cfg_path.read_bytes(), st_path.read_bytes()
    try:
        cfg = json.loads(raw_cfg)
    except json.JSONDecodeError as e:
        raise _refuse(name, f"{cfg_path} is not JSON: {e}") from None
    _check_config(name, cfg, max_rank)
    tensors = load_file(str(st_path))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or any(v in m["prefix"] for v in _VISION):
            raise _refuse(name, f"tensor {key!r} targets a module the engine does not wrap; LoRA applies to "
                                f"the language model's {list(TARGET_MODULES)}")
        layer, module = int(m["layer"]), m["module"]
        if module not in shapes:
            raise _refuse(name, f"target module {module!r} (tensor {key!r}) is not supported; LoRA applies to "
                                f"the language model's {list(TARGET_MODULES)}")
        if layer >= num_layers:
            raise _refuse(name, f"tensor {key!r} is for layer {layer}, but the base model has {num_layers} layers")
        parts.setdefault((layer, module), {})[m["ab"]] = t.to(torch.float32)
    weights, rank = {}, 0
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise _refuse(name, f"layers.{layer}.{module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise _refuse(name, f"layers.{layer}.{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                                f"the base model's {module} (in {fan_in}, out {fan_out}): an adapter of another model?")
        if r > max_rank:
            raise _refuse(name, f"layers.{layer}.{module} has rank {r}, above max_lora_rank={max_rank}")
        weights[(layer, module)] = (a, b)
        rank = max(rank, r)
    if not weights:
        raise _refuse(name, f"{st_path} holds no lora_A / lora_B tensors")
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r  # peft's LoraLayer.update_layer
    fingerprint = hashlib.blake2b(raw_cfg + b"\0" + raw_st, digest_size=16).hexdigest()
    return LoRAAdapter(name, str(folder), rank, scaling, weights, fingerprint)
