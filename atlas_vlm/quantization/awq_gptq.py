"""AWQ and GPTQ safetensors checkpoints in their released layout, read as stored into
``Int4Linear`` (4 bits, groups along the inputs; ``W = (q - z) * s`` becomes
``scale = s``, ``min = -z * s``, exact in fp32; ``finalize`` keeps them fp32 unless every one
is exact in fp16 too, as symmetric GPTQ's ``min = -8 s``: then fp16).

AWQ (AutoAWQ ``version: "gemm"``, e.g. the Qwen2.5-VL AWQ releases): ``qweight`` int32
``[in, out / 8]`` and ``qzeros`` int32 ``[in / group, out / 8]``, eight 4-bit values per int32
along the outputs in AWQ's order (nibble ``i`` holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``),
``scales`` fp16 ``[in / group, out]``.

GPTQ (AutoGPTQ / GPTQModel ``checkpoint_format: "gptq"``): ``qweight`` int32 ``[in / 8, out]``
(eight inputs per int32, nibble ``j`` = input ``8 i + j``), ``qzeros`` int32
``[in / group, out / 8]`` (outputs in order, stored as ``z - 1``), ``scales`` fp16
``[in / group, out]``, ``g_idx`` int32 ``[in]`` (must be ``k // group``: ``desc_act`` is refused).

The checkpoint's ``quantization_config`` is read and honoured: ``bits`` (4), ``group_size``
(32 / 64 / 128 / 256, or -1 = one group), AWQ ``zero_point`` (True) and ``version`` ("gemm"),
GPTQ ``desc_act`` (False) and ``checkpoint_format`` ("gptq"); any other value is refused
by name. A projection stored dense (``modules_to_not_convert``) loads as ``nn.Linear``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from atlas_vlm.layers.quant_linear import Int4Linear
from atlas_vlm.quantization import DECODER_LINEARS, UnsupportedQuantizationError, materialize

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., m]`` -> ``[..., m, 8]`` 4-bit values (nibble 0 = lowest bits)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (packed.to(torch.int32)[..., None] >> shifts) & 15


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ ``qweight`` ``[in, out / 8]``, ``qzeros`` ``[G, out / 8]`` -> ``q`` ``[out, in]``,
    ``z`` ``[G, out]`` (int values 0..15)."""
    inv = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])  # column c sits in nibble inv[c]

    def cols(p):
        return _nibbles(p)[..., inv].reshape(p.shape[0], -1)

    return cols(qweight).t().contiguous(), cols(qzeros)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ ``qweight`` ``[in / 8, out]``, ``qzeros`` ``[G, out / 8]`` -> ``q`` ``[out, in]``,
    ``z`` ``[G, out]`` (``z`` = stored + 1, the v1 format)."""
    q = _nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [in, out]
    z = _nibbles(qzeros).reshape(qzeros.shape[0], -1) + 1
    return q.t().contiguous(), z


def check_config(method: str, qc: dict) -> int:
    """Validate a checkpoint's ``quantization_config``; returns ``group_size`` (-1 kept).

    Raises:
        UnsupportedQuantizationError: a field value outside what is supported (named).
    """
    def refuse(field, value, allowed):
        raise UnsupportedQuantizationError(f"{method} checkpoint quantization_config.{field}={value!r} is not "
                                           f"supported (supported: {allowed})")

    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        refuse("bits", bits, 4)
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group not in (-1, 32, 64, 128, 256):
        refuse("group_size", group, "32, 64, 128, 256 or -1")
    if method == "awq":
        if not qc.get("zero_point", True):
            refuse("zero_point", qc.get("zero_point"), True)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            refuse("version", version, "'gemm'")
    else:
        if qc.get("desc_act", False):
            refuse("desc_act", qc.get("desc_act"), False)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt != "gptq":
            refuse("checkpoint_format", fmt, "'gptq'")
    return group


def load_awq_gptq(model: nn.Module, files: list[Path], method: str, qc: dict, dense_loader=None):
    """Load an AWQ / GPTQ checkpoint into ``model`` (built on ``meta``): each decoder
    projection with a ``qweight`` becomes an ``Int4Linear`` filled as stored, the rest loads
    dense.

    Returns:
        ``(model, vision_state_dict)``.

    Raises:
        UnsupportedQuantizationError: a ``quantization_config`` value we do not run (named).
        ValueError: a tensor is missing, unexpected, or of the wrong shape (named); GPTQ
            ``g_idx`` not ``k // group_size``.
    """
    from atlas_vlm.checkpoint import copy_dense, our_name as _our_name

    group_cfg = check_config(method, qc)
    arch = model.arch
    qkv_sizes = [arch.num_heads * arch.head_dim] + [arch.num_kv_heads * arch.head_dim] * 2
    handles = [safe_open(str(p), framework="pt") for p in files]
    where = {k: h for h in handles for k in h.keys()}
    # which projections are stored quantized: one Int4Linear each (the others stay nn.Linear)
    quant: dict[str, dict[int | None, dict[str, str]]] = {}
    for hf_name in where:
        base, _, suffix = hf_name.rpartition(".")
        if suffix in QUANT_SUFFIXES:
            kind, name, shard = _our_name(base + ".weight")
            if kind != "text":
                raise ValueError(f"{method} tensor {hf_name} is outside the decoder; Atlas VLM quantizes decoder "
                                 f"projections only")
            quant.setdefault(name[: -len(".weight")], {}).setdefault(shard, {})[suffix] = hf_name
    for path in quant:
        parent_path, attr = path.rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        lin = getattr(parent, attr)
        if attr not in DECODER_LINEARS or not isinstance(lin, nn.Linear):
            raise ValueError(f"{method} checkpoint quantizes {path}, which Atlas VLM keeps dense")
        group = lin.in_features if group_cfg == -1 else group_cfg
        setattr(parent, attr, Int4Linear(lin.in_features, lin.out_features, lin.bias is not None, group_size=group))
    materialize(model)
    params = dict(model.named_parameters())
    loaded, unexpected, visual = set(), [], {}
    for path, shards in quant.items():
        module = model.get_submodule(path)
        sizes = qkv_sizes if path.endswith("qkv_proj") else [arch.intermediate_size] * 2
        for shard, names in shards.items():
            missing = [s for s in ("qweight", "qzeros", "scales") if s not in names]
            if missing:
                raise ValueError(f"{method} projection {path} (shard {shard}) lacks {missing}")
            qw, qz = where[names["qweight"]].get_tensor(names["qweight"]), where[names["qzeros"]].get_tensor(names["qzeros"])
            scales = where[names["scales"]].get_tensor(names["scales"]).float()  # [G, out]
            q, z = unpack_awq(qw, qz) if method == "awq" else unpack_gptq(qw, qz)
            if method == "gptq" and "g_idx" in names:
                g_idx = where[names["g_idx"]].get_tensor(names["g_idx"])
                want = torch.arange(q.shape[1]) // module.group_size
                if not torch.equal(g_idx.long(), want):
                    raise ValueError(f"gptq {names['g_idx']} is not k // group_size (act-order); not supported")
            if tuple(scales.shape) != tuple(z.shape):
                raise ValueError(f"{method} {names['scales']} has shape {tuple(scales.shape)}, zeros {tuple(z.shape)}")
            row = 0 if shard is None else sum(sizes[:shard])
            module.load_rows(row, q, scales.t(), (-z.float() * scales).t())  # W = q s - z s, [out, G] each
            loaded.add(f"{path}.weight" + ("" if shard is None else f"#{shard}"))
    for hf_name, handle in where.items():
        if hf_name.rpartition(".")[2] in QUANT_SUFFIXES:
            continue
        kind, name, shard = _our_name(hf_name)
        if kind == "visual":
            visual[name] = handle.get_tensor(hf_name)
            continue
        if kind is None:
            continue
        if name not in params:
            unexpected.append(hf_name)
            continue
        loaded.add(copy_dense(params[name].data, name, shard, handle.get_tensor(hf_name), hf_name, arch, qkv_sizes))
    expected = set()
    for name in list(params) + [f"{p}.weight" for p in quant]:
        n = 3 if "qkv_proj." in name else 2 if "gate_up_proj." in name else 0
        expected |= {f"{name}#{i}" for i in range(n)} if n else {name}
    if arch.tie_word_embeddings:
        expected.discard("lm_head.weight")
        loaded.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(f"{method} checkpoint does not match {arch.family}: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    return model, visual
