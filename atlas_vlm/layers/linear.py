"""CPU bf16 linear layers over oneDNN-packed weights.

``F.linear`` in bf16 on CPU calls oneDNN with the plain ``[out, in]`` weight and reorders it
into oneDNN's blocked layout on every call. Reordering once at load time (what
``torch.compile``'s CPU weight freezing does: ``torch.ops.mkldnn._reorder_linear_weight`` +
``torch.ops.mkldnn._linear_pointwise``) gives the same bits and, on this project's
AVX512-BF16 CPU with SmolLM2-135M's shapes, 1.5-1.9x the speed of one decode token's GEMV,
1.2-1.3x at 32 rows and 1.02-1.05x at 2,048 (``python -m benchmarks.linear``). The engine packs
its decoder and vision tower on such CPUs (``ModelRunner``). fp32 keeps ``nn.Linear``: it is
the exactness reference.

oneDNN's bf16 path runs only on CPUs that PyTorch's ``mkldnn_bf16_device_check`` accepts
(AVX512-BW/VL/DQ, AVX-NE-CONVERT or AMX on x86; BF16 on aarch64): elsewhere the reorder raises,
so ``can_pack`` asks ``hardware.cpu_features().onednn_bf16`` and the model keeps ``nn.Linear``
(the same bits, slower).
"""

from __future__ import annotations

import torch
from torch import nn

from atlas_vlm import hardware


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``pack_linears`` applies: bf16 on a CPU that runs oneDNN's bf16 path
    (``hardware.cpu_features().onednn_bf16``), with a torch that has oneDNN and its ops."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and hardware.cpu_features().onednn_bf16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward (``x @ W^T + b``, ``x`` ``[..., in_features]`` ->
    ``[..., out_features]``) over the weight reordered once into oneDNN's layout.

    The packed weight is an opaque oneDNN tensor held as a plain attribute (not a parameter:
    it cannot be saved or loaded; the model's ``state_dict`` no longer lists it). The bias,
    if any, stays a parameter.

    Raises:
        ValueError: ``linear`` is not bf16.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.dtype != torch.bfloat16:
            raise ValueError(f"PackedLinear packs bf16 weights, got {linear.weight.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # batch-size hint 1: the layout for decode GEMVs; it serves any number of rows, bit-exactly.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # opaque to the compiler (worker/compiled_decode.py)
            return torch.ops.atlas_vlm.packed_linear(x, self.packed_weight, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module) -> int:
    """Replace every bf16 ``nn.Linear`` under ``module`` by a ``PackedLinear`` (in place; a
    weight tied elsewhere, e.g. an LM head tied to the embedding, stays where else it is used).

    Returns:
        the number of layers replaced.
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count


@torch.library.custom_op("atlas_vlm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``PackedLinear.forward`` as one op the compiler does not look into: ``x`` ``[n, in]`` ->
    ``[n, out_features]`` (inductor lowers ``mkldnn._linear_pointwise`` only over a frozen
    constant weight, which the packed attribute is not)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)
