"""Weight-only quantized linear layers: int8 (per channel or group-wise scales) and int4
(group-wise scales and zeros), with a library kernel behind ``forward`` and the dequantized
reference beside it.

Formats (one per module, whatever the source: quantized at load, GGUF, AWQ, GPTQ):

- ``Int8Linear``: ``W[n, k] = q[n, k] * scale[n, k // group_size]``, ``q`` int8 in
  ``[-127, 127]`` (Q8_0 stores ``-128`` too). ``group_size == in_features`` is per channel.
- ``Int4Linear``: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``, ``g = k // group_size``,
  ``q`` in ``[0, 15]``: PyTorch's int4 convention (``_weight_int4pack_mm``). Symmetric int4
  (GGUF Q4_0) has ``zero = 0``; an integer zero point ``z`` (AWQ / GPTQ) is
  ``zero = (8 - z) * scale``; GGUF Q4_1's ``d * q + m`` is ``scale = d``, ``zero = m + 8 d``.

Kernels, chosen by measurement on this project's 2-core AMD EPYC (AVX512-BF16; one thread;
SmolLM2-135M's shapes, one decode row; ``python -m benchmarks.quant_linear``): in bf16,
``torch.ops.aten._weight_int4pack_mm_for_cpu`` takes 24-127 us per decoder projection
against 67-394 us for dense bf16 ``F.linear`` (1.7-3.7x; the 49152-row LM head 2.9-3.3 ms
against 9.9 ms), ``_weight_int8pack_mm`` 25-97 us (2.2-4.1x); both ops with fp32 inputs are
unvectorised (10-30x slower than dense fp32). (The engine's dense bf16 layers are
``PackedLinear``, 1.5-1.9x faster than ``F.linear`` for one row, so the margin over the dense
engine is smaller.) So the kernel path runs the op in bf16 (an fp32 input is rounded to bf16,
the result cast back), and is used only where :func:`quant_kernel_available` says the CPU has native bf16
(AVX512-BF16 / AMX); elsewhere (AVX2-only CPUs, CUDA) ``forward`` dequantizes the weight to
the input's dtype and calls ``F.linear``: the reference, the same answer up to bf16
rounding of the input (bounds in ``tests/parity/test_quant_linear.py``). ``torchao``'s CPU
int4 layout calls the same aten op, so it is not a dependency.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atlas_vlm import hardware

INT4_PACK_BLOCK_N = 64  # rows per block in _convert_weight_to_int4pack_for_cpu's layout
INT4_GROUP_SIZES = (128, 64, 32)  # default group first; the kernel accepts 32, 64, 128, 256
DEFAULT_INT4_GROUP_SIZE = 128


def quant_kernel_available(device: torch.device | str = "cpu", cpu: "hardware.CpuFeatures | None" = None,
                           aten_capability: str | None = None) -> bool:
    """Whether quantized linears use the aten kernels: a CPU with native bf16 dot products
    (``hardware.cpu_features().fast_bf16``, or ``cpu``'s), ATen dispatching its AVX-512
    kernels (``torch.backends.cpu.get_cpu_capability()``, or ``aten_capability``: the int4
    op's packed layout, 64-row blocks as ``pack_int4_cpu`` writes them, is the AVX-512
    kernel's; under ``ATEN_CPU_CAPABILITY=avx2`` it differs), and a torch that has
    ``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu`` and
    ``_convert_weight_to_int4pack_for_cpu``. Tests pass ``cpu`` / ``aten_capability`` (or
    patch this function or ``hardware.cpu_features``) to fake either answer."""
    ops = ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    capability = aten_capability or torch.backends.cpu.get_cpu_capability()
    return (torch.device(device).type == "cpu" and all(hasattr(torch.ops.aten, op) for op in ops)
            and (cpu or hardware.cpu_features()).fast_bf16 and capability.upper().startswith("AVX512"))


def int4_group_size(in_features: int, preferred: int = DEFAULT_INT4_GROUP_SIZE) -> int:
    """The int4 group size for a layer of ``in_features`` inputs: ``preferred`` (128) when it
    divides ``in_features``, else the largest of 64 and 32 that does (SmolLM2's 576 -> 64).

    Raises:
        ValueError: ``in_features`` is not a multiple of 32.
    """
    for g in (preferred,) + tuple(s for s in INT4_GROUP_SIZES if s < preferred):
        if in_features % g == 0:
            return g
    raise ValueError(f"int4 needs in_features divisible by 32 (a group size), got {in_features}")


# ---- packing -----------------------------------------------------------------------------------

def pack_int4_plain(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values 0..15 -> ``[N, K // 2]`` uint8, column ``2j`` in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4_plain(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_plain`: ``[N, K // 2]`` uint8 -> ``[N, K]`` uint8."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def pack_int4_cpu(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values 0..15 (``N % 64 == 0``) -> the ``[N, K // 2]`` uint8 layout of
    ``torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)`` (blocks of 64 rows: byte
    ``(b, k, j)`` holds row ``64b + j`` low and ``64b + 32 + j`` high). Pure torch, equal to the
    op (tested), so the reference can unpack it."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n // 64, 2, 32, k)
    return (b[:, 0] | (b[:, 1] << 4)).permute(0, 2, 1).contiguous().view(n, k // 2)


def unpack_int4_cpu(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_cpu`: ``[N, K // 2]`` uint8 -> ``[N, K]`` uint8."""
    n, half = packed.shape
    k = half * 2
    b = packed.view(n // 64, k, 32).permute(0, 2, 1)  # [blocks, 32, K]
    return torch.stack([b & 15, b >> 4], dim=1).reshape(n, k)


# ---- round-to-nearest quantizers ----------------------------------------------------------------

def quantize_int8_rtn(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 of ``w`` ``[N, K]``: ``scale = absmax / 127`` per row
    (``group_size=None``) or per group of ``group_size`` columns.

    Returns:
        ``q`` int8 ``[N, K]``, ``scales`` fp32 ``[N, K // group_size]``.
    """
    w = w.float()
    n, k = w.shape
    g = group_size or k
    wg = w.view(n, k // g, g)
    scales = (wg.abs().amax(-1) / 127.0).clamp(min=1e-12)  # [N, G]
    q = torch.round(wg / scales[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return q, scales


def quantize_int4_rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 of ``w`` ``[N, K]`` in groups of ``group_size``
    columns (gpt-fast's ``group_quantize_tensor``): ``scale = (max - min) / 15``,
    ``q = round((w - min) / scale)`` in ``[0, 15]``, ``zero = min + 8 scale``.

    Returns:
        ``q`` uint8 ``[N, K]``, ``scales_and_zeros`` fp32 ``[K // group_size, N, 2]``.
    """
    w = w.float()
    n, k = w.shape
    wg = w.view(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    zeros = lo + 8.0 * scales
    return q, torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()


# ---- modules ------------------------------------------------------------------------------------

class _QuantLinear(nn.Module):
    """Shared parts: shape, optional dense bias, kernel switch (set by ``finalize``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.use_kernel = False

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> ``[..., out_features]`` in ``x.dtype``."""
        if self.use_kernel:
            shape = x.shape
            out = self._kernel(x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous())
            out = out.to(x.dtype).view(*shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear`` over :meth:`dequantize` in ``x.dtype``: the exactness reference."""
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def weight_bytes(self) -> int:
        """Bytes of every tensor this module holds (quantized weight, scales, zeros, bias)."""
        return sum(t.numel() * t.element_size() for t in list(self.parameters()) + list(self.buffers()))


class Int8Linear(_QuantLinear):
    """Weight-only int8 linear: ``W = q * scale`` (see the module docstring).

    Buffers: ``qweight`` int8 ``[N, K]`` (after ``finalize(True)`` with groups:
    ``[K // group_size, N, group_size]``), ``scales`` ``[N, K // group_size]`` (fp32, or the
    model dtype; bf16 once the kernel is on). ``bias`` a dense parameter or None.

    Raises:
        ValueError: ``group_size`` does not divide ``in_features``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        self.group_size = group_size or in_features
        if in_features % self.group_size:
            raise ValueError(f"int8 group_size {self.group_size} does not divide in_features {in_features}")
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(out_features, in_features // self.group_size, dtype=torch.float32))
        self.grouped_layout = False

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int | None = None) -> Int8Linear:
        """Round-to-nearest int8 of a dense ``nn.Linear`` (per channel by default)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size)
        m.load_rows(0, *quantize_int8_rtn(linear.weight.detach(), group_size))
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        return m

    def load_rows(self, row: int, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Write rows ``row .. row + len(q)`` (before ``finalize``): ``q`` int8 ``[n, K]``,
        ``scales`` ``[n, K // group_size]``.

        Raises:
            ValueError: shapes do not match this layer.
        """
        n = q.shape[0]
        if tuple(q.shape) != (n, self.in_features) or tuple(scales.shape) != (n, self.in_features // self.group_size) \
                or row + n > self.out_features:
            raise ValueError(f"int8 rows {tuple(q.shape)} / scales {tuple(scales.shape)} do not fit rows {row}.. of a "
                             f"[{self.out_features}, {self.in_features}] layer with group {self.group_size}")
        self.qweight[row:row + n].copy_(q)
        self.scales[row:row + n].copy_(scales)

    def load_dense_rows(self, row: int, w: torch.Tensor) -> None:
        """Quantize dense rows ``w`` ``[n, K]`` (round to nearest) into rows ``row ..``."""
        self.load_rows(row, *quantize_int8_rtn(w, self.group_size))

    def finalize(self, use_kernel: bool) -> None:
        """After loading: switch to the kernel layout (bf16 scales; groups as
        ``[G, N, group_size]``) when ``use_kernel``."""
        self.use_kernel = bool(use_kernel)
        if self.use_kernel:
            self.scales = self.scales.to(torch.bfloat16)
            if self.group_size != self.in_features and not self.grouped_layout:
                g = self.in_features // self.group_size
                self.qweight = self.qweight.view(self.out_features, g, self.group_size).permute(1, 0, 2).contiguous()
                self.scales = self.scales.t().contiguous()  # [G, N]
                self.grouped_layout = True

    def _q_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.grouped_layout:  # [G, N, gs], [G, N] -> [N, K], [N, G]
            return self.qweight.permute(1, 0, 2).reshape(self.out_features, self.in_features), self.scales.t()
        return self.qweight, self.scales

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[N, K]`` weight in ``dtype`` (computed in fp32)."""
        q, s = self._q_and_scales()
        g = self.in_features // self.group_size
        w = q.float().view(self.out_features, g, self.group_size) * s.float()[..., None]
        return w.view(self.out_features, self.in_features).to(dtype)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense rows ``W[rows]`` ``[len(rows), K]``: an embedding lookup from this weight."""
        g = self.in_features // self.group_size
        if self.grouped_layout:  # [G, N, gs], [G, N]: gather the rows without unpermuting the table
            q, s = self.qweight[:, rows].permute(1, 0, 2), self.scales[:, rows].t()
        else:
            q, s = self.qweight[rows], self.scales[rows]
        w = q.float().reshape(-1, g, self.group_size) * s.float()[..., None]
        return w.reshape(-1, self.in_features).to(dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if not self.grouped_layout:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales.view(-1))
        # group-wise scales (GGUF Q8_0): one per-channel call per group of columns, fp32 sum
        xg = x.view(x.shape[0], -1, self.group_size)
        out = torch.zeros(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for g in range(xg.shape[1]):
            out += torch.ops.aten._weight_int8pack_mm(xg[:, g].contiguous(), self.qweight[g], self.scales[g])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, kernel={self.use_kernel}")


class Int4Linear(_QuantLinear):
    """Weight-only int4 linear with group-wise scales and zeros:
    ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` (see the module docstring).

    Buffers: ``qweight`` uint8 ``[N, K // 2]`` (two values a byte; plain layout, or
    :func:`pack_int4_cpu`'s once the kernel is on), ``scales_and_zeros``
    ``[K // group_size, N, 2]`` (fp32 or the model dtype; bf16 with the kernel).
    The kernel needs ``N % 64 == 0``; other layers keep the reference path.

    Raises:
        ValueError: ``group_size`` does not divide ``in_features`` or ``in_features`` is odd.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group_size: int = DEFAULT_INT4_GROUP_SIZE, dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        if in_features % group_size or in_features % 2:
            raise ValueError(f"int4 group_size {group_size} does not divide in_features {in_features}")
        self.group_size = group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros",
                             torch.zeros(in_features // group_size, out_features, 2, dtype=torch.float32))
        self.cpu_layout = False

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int | None = None) -> Int4Linear:
        """Round-to-nearest int4 of a dense ``nn.Linear`` (group size from :func:`int4_group_size`)."""
        g = group_size or int4_group_size(linear.in_features)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, g)
        m.load_rows(0, *quantize_int4_rtn(linear.weight.detach(), g))
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        return m

    def load_rows(self, row: int, q: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        """Write rows ``row .. row + len(q)`` (before ``finalize``): ``q`` ``[n, K]`` values
        0..15, ``scales_and_zeros`` ``[K // group_size, n, 2]``.

        Raises:
            ValueError: shapes do not match this layer.
        """
        n = q.shape[0]
        if tuple(q.shape) != (n, self.in_features) or row + n > self.out_features \
                or tuple(scales_and_zeros.shape) != (self.in_features // self.group_size, n, 2):
            raise ValueError(f"int4 rows {tuple(q.shape)} / scales {tuple(scales_and_zeros.shape)} do not fit rows "
                             f"{row}.. of a [{self.out_features}, {self.in_features}] layer with group {self.group_size}")
        self.qweight[row:row + n].copy_(pack_int4_plain(q))
        self.scales_and_zeros[:, row:row + n].copy_(scales_and_zeros)

    def load_dense_rows(self, row: int, w: torch.Tensor) -> None:
        """Quantize dense rows ``w`` ``[n, K]`` (round to nearest) into rows ``row ..``."""
        self.load_rows(row, *quantize_int4_rtn(w, self.group_size))

    def finalize(self, use_kernel: bool) -> None:
        """After loading: repack for ``_weight_int4pack_mm_for_cpu`` (bf16 scales) when
        ``use_kernel`` and ``out_features % 64 == 0``; otherwise keep the reference path."""
        self.use_kernel = bool(use_kernel) and self.out_features % INT4_PACK_BLOCK_N == 0
        if self.use_kernel and not self.cpu_layout:
            self.qweight = pack_int4_cpu(unpack_int4_plain(self.qweight))
            self.scales_and_zeros = self.scales_and_zeros.to(torch.bfloat16)
            self.cpu_layout = True

    def unpacked(self) -> torch.Tensor:
        """``q`` as ``[N, K]`` uint8 values 0..15, whatever the layout."""
        return unpack_int4_cpu(self.qweight) if self.cpu_layout else unpack_int4_plain(self.qweight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[N, K]`` weight in ``dtype`` (computed in fp32)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        sz = self.scales_and_zeros.float()  # [G, N, 2]
        q = self.unpacked().float().view(n, k // g, g)
        w = (q - 8.0) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
        return w.view(n, k).to(dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, kernel={self.use_kernel}")


class QuantEmbedding(nn.Module):
    """An embedding whose table is an ``Int8Linear``'s weight (a tied LM head stored
    quantized, e.g. GGUF Q8_0 ``token_embd``): rows dequantized on lookup.

    Args:
        table: the quantized ``[vocab, hidden]`` weight.
        dtype: the dtype of the returned rows.
    """

    def __init__(self, table: Int8Linear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[n]`` -> ``[n, hidden]``."""
        return self.table.dequantize_rows(ids.reshape(-1), self.dtype).view(*ids.shape, self.embedding_dim)


def quantized_modules(module: nn.Module) -> list[_QuantLinear]:
    """Every ``Int8Linear`` / ``Int4Linear`` under ``module`` (each once)."""
    seen, out = set(), []
    for m in module.modules():
        if isinstance(m, _QuantLinear) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def finalize_quantized(module: nn.Module, use_kernel: bool) -> int:
    """``finalize(use_kernel)`` on every quantized linear under ``module``; returns how many
    run the kernel."""
    mods = quantized_modules(module)
    for m in mods:
        m.finalize(use_kernel)
    return sum(m.use_kernel for m in mods)
