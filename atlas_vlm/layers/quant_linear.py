"""Weight-only quantized linear layers: int8 (per channel or group-wise scales) and int4
(group-wise scales and mins), the quantized matmul kernel behind ``forward`` and the
dequantized reference beside it.

Formats (one per module, whatever the source: quantized at load, GGUF, AWQ, GPTQ):

- ``Int8Linear``: ``W[n, k] = q[n, k] * scale[n, k // group_size] (+ min[n, k // group_size])``,
  ``q`` int8 in ``[-127, 127]`` (Q8_0 stores ``-128`` too), mins only with ``has_min`` (GGUF
  Q5_1 / Q5_K / Q2_K). ``group_size == in_features`` is per channel.
- ``Int4Linear``: ``W[n, k] = q[n, k] * scale[n, g] + min[n, g]``, ``g = k // group_size``,
  ``q`` in ``[0, 15]`` (GGUF Q4_1's ``d * q + m``; Q4_0 is ``min = -8 d``; an integer zero
  point ``z`` (AWQ / GPTQ) is ``min = -z * scale``).

Storage: tiles of 16 output rows (``quant_format``, the layout ``quant_kernel`` reads). Scales keep their own dtype whatever the model's:
fp16 where every value is exact in fp16 (GGUF, round to nearest at load), else fp32 (AWQ /
GPTQ mins); ``model.to(dtype)`` moves them, never rounds them.

``forward``: on CUDA (``triton_quant_available``) through the Triton matmuls that dequantize the
tiles in registers (``kernels/triton_quant``: a split-K GEMV for up to 8 rows, a tiled GEMM
above). On CPU with the kernel built (``quant_kernel_available``), up to
``KERNEL_MAX_ROWS`` rows (decode; fp32: every call) go through ``quant_kernel.quant_matmul``
(activations quantized to int8 per block of 32, as llama.cpp), more rows (bf16 prefill)
through the weight dequantized by the kernel and a dense ``F.linear``. Elsewhere (no compiler, fp16 on CPU)
``forward`` is the reference: ``F.linear`` over :meth:`dequantize` in the input's dtype.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from atlas_vlm.kernels import quant_kernel
from atlas_vlm.kernels.quant_kernel import KernelTensors, dense_workspace
from atlas_vlm.layers.quant_format import (DEFAULT_INT4_GROUP_SIZE, TILE, fp16_exact, from_tiles,  # noqa: F401
                                           int4_group_size, num_tiles, pack_int4_row, quantize_activations,
                                           quantize_int4_rtn, quantize_int8_rtn, row_index, row_view, to_tiles,
                                           unpack_int4_row)

# Rows per call through the int8 kernel, by activation dtype; more rows (prefill) go through the
# dequantized weight and a dense GEMM. Measured (python -m benchmarks.quant_linear --sweep, one
# thread, SmolLM2's shapes, Intel with AMX): in bf16 the kernel wins up to 32-48 rows; in fp32
# it wins at every row count measured (1..1,024), so fp32 never leaves it.
KERNEL_MAX_ROWS = {torch.bfloat16: 48, torch.float32: 1 << 62}


def quant_kernel_available(device: torch.device | str = "cpu") -> bool:
    """Whether quantized linears on ``device`` use the kernel: a CPU where
    ``quant_kernel`` builds (any x86-64 or aarch64 with a C compiler). Tests patch this to
    fake either answer."""
    return torch.device(device).type == "cpu" and quant_kernel.available()


def triton_quant_available(device: torch.device | str) -> bool:
    """Whether quantized linears on ``device`` run the Triton matmuls (``kernels/triton_quant``):
    a CUDA device with ``triton`` installed. Tests patch this to fake a CUDA device."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


# ---- modules ------------------------------------------------------------------------------------

class _QuantLinear(nn.Module):
    """Shared parts: shape, group, tiles, optional dense bias, kernel switch (``finalize``)."""

    SCALE_BUFFERS: tuple[str, ...] = ("scales",)

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, dtype: torch.dtype,
                 scale_buffers: tuple[str, ...] | None = None):
        super().__init__()
        self.SCALE_BUFFERS = scale_buffers or type(self).SCALE_BUFFERS
        if in_features % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        for name in self.SCALE_BUFFERS:
            self.register_buffer(name, torch.zeros(num_tiles(out_features), in_features // group_size, TILE))
        self.use_kernel = False
        self._bias_f32: torch.Tensor | None = None

    def _apply(self, fn, recurse=True):
        # Scales keep their dtype (fp16 or fp32, exact as loaded); only their device follows fn.
        saved = {name: self._buffers.pop(name) for name in self.SCALE_BUFFERS}
        super()._apply(fn, recurse)
        device = fn(torch.zeros(1, device=next(iter(saved.values())).device)).device
        for name, t in saved.items():
            self._buffers[name] = t.to(device)
        return self

    def _scale_rows(self, row: int, **values: torch.Tensor) -> None:
        g = self.in_features // self.group_size
        for name, v in values.items():
            if tuple(v.shape) != (v.shape[0], g):
                raise ValueError(f"{name} of shape {tuple(v.shape)} do not fit a layer with {g} groups a row")
            row_view(getattr(self, name))[row_index(row, v.shape[0])] = v.to(getattr(self, name).dtype)

    def _check_rows(self, row: int, q: torch.Tensor) -> None:
        n = q.shape[0]
        if q.dim() != 2 or q.shape[1] != self.in_features or row < 0 or row + n > self.out_features:
            raise ValueError(f"rows {tuple(q.shape)} at row {row} do not fit a [{self.out_features}, "
                             f"{self.in_features}] layer")

    def finalize(self, use_kernel: bool) -> None:
        """After loading: scales (and mins) to fp16 where every value is exact in it, and the
        kernel switched on when ``use_kernel`` and the sizes suit it (``in_features`` a
        multiple of 32, the group too or 16: GGUF Q6_K / Q3_K / Q2_K)."""
        scales = [getattr(self, n) for n in self.SCALE_BUFFERS]
        if all(s.dtype != torch.float16 for s in scales) and all(fp16_exact(s) for s in scales):
            for name, s in zip(self.SCALE_BUFFERS, scales):
                self._buffers[name] = s.to(torch.float16)
        self.use_kernel = bool(use_kernel) and self.in_features % 32 == 0 and \
            (self.group_size % 32 == 0 or self.group_size == 16)
        self._bias_f32 = None if self.bias is None else self.bias.detach().float().contiguous()

    def _mins(self) -> torch.Tensor | None:
        return None

    def kernel_tensors(self) -> KernelTensors | None:
        """The tensors the C kernels read (``kernels.decode_step``'s one-call step), or None
        when this linear is not on the kernel path (``finalize`` with ``use_kernel`` off or
        sizes the kernels do not take)."""
        if not self.use_kernel:
            return None
        return KernelTensors(self.qweight, self.scales, self._mins(), self._bias_f32, self.out_features,
                             self.in_features, self.group_size, isinstance(self, Int4Linear))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> ``[..., out_features]`` in ``x.dtype``."""
        if x.dtype in (torch.float32, torch.float16, torch.bfloat16) and triton_quant_available(x.device):
            from atlas_vlm.kernels.triton_quant import quant_linear_triton

            out = quant_linear_triton(x.reshape(-1, self.in_features), self.qweight, self.scales, self._mins(),
                                      self.out_features, self.group_size, self.bias)  # [rows, N]
            return out.view(*x.shape[:-1], self.out_features)
        if not (self.use_kernel and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)):
            return self.forward_reference(x)
        x2 = x.reshape(-1, self.in_features).contiguous()  # [rows, K]
        if torch.compiler.is_compiling():  # opaque to the compiler (worker/compiled_decode.py)
            out = torch.ops.atlas_vlm.quant_linear(x2, self.qweight, self.scales, self._mins(), self._bias_f32,
                                                   self.out_features, self.group_size)
        elif x2.shape[0] <= KERNEL_MAX_ROWS[x.dtype]:
            out = quant_kernel.quant_matmul(x2, self.qweight, self.scales, self._mins(), self.out_features,
                                            self.group_size, self._bias_f32)
        else:  # prefill: the dense GEMM beats int8 dot products at many rows
            w = quant_kernel.dequantize(self.qweight, self.scales, self._mins(), self.out_features,
                                        self.in_features, self.group_size, x.dtype,
                                        out=dense_workspace(self.out_features, self.in_features, x.dtype))
            out = F.linear(x2, w, None if self.bias is None else self.bias.to(x.dtype))
        return out.view(*x.shape[:-1], self.out_features)

    def kernel_reference(self, x: torch.Tensor) -> torch.Tensor:
        """What the kernel path computes, in PyTorch ops: at up to ``KERNEL_MAX_ROWS`` rows the
        activations quantized as the kernel does (:func:`quantize_activations`) and ``F.linear``
        over the fp32 dequantized weight (the kernel's int32 sums are exact, so it differs only
        in fp32 summation order), then bias and the cast to ``x.dtype``; above, the dense path
        as ``forward`` runs it. Tests compare the kernel with this."""
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > KERNEL_MAX_ROWS[x.dtype]:
            return self.forward_reference(x)
        out = F.linear(quantize_activations(x2.float()), self.dequantize(torch.float32))
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear`` over :meth:`dequantize` in ``x.dtype``: the exactness reference."""
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def weight_bytes(self) -> int:
        """Bytes of every tensor this module holds (quantized weight, scales, mins, bias)."""
        return sum(t.numel() * t.element_size() for t in list(self.parameters()) + list(self.buffers()))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, scales={self.scales.dtype}, kernel={self.use_kernel}")


class Int8Linear(_QuantLinear):
    """Weight-only int8 linear: ``W = q * scale (+ min)`` (see the module docstring).

    Buffers: ``qweight`` int8 ``[T, K / 4, 16, 4]``, ``scales`` (and with ``has_min``
    ``mins``) ``[T, K / group_size, 16]``. ``bias`` a dense parameter or None.

    Raises:
        ValueError: ``group_size`` does not divide ``in_features``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int | None = None,
                 dtype: torch.dtype = torch.float32, has_min: bool = False):
        super().__init__(in_features, out_features, bias, group_size or in_features, dtype,
                         ("scales", "mins") if has_min else ("scales",))
        self.has_min = has_min
        if in_features % 4:
            raise ValueError(f"int8 needs in_features divisible by 4, got {in_features}")
        self.register_buffer("qweight", torch.zeros(num_tiles(out_features), in_features // 4, TILE, 4,
                                                    dtype=torch.int8))

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int | None = None) -> Int8Linear:
        """Round-to-nearest int8 of a dense ``nn.Linear`` (per channel by default)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size)
        m.load_rows(0, *quantize_int8_rtn(linear.weight.detach(), group_size))
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        return m

    def load_rows(self, row: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> None:
        """Write rows ``row .. row + len(q)``: ``q`` int8 ``[n, K]``, ``scales`` (``mins``, given
        exactly when ``has_min``) ``[n, K // group_size]``.

        Raises:
            ValueError: shapes do not match this layer, or mins given without ``has_min`` / missing with it.
        """
        self._check_rows(row, q)
        if (mins is not None) != self.has_min:
            raise ValueError(f"mins {'missing for' if self.has_min else 'given to'} an Int8Linear with "
                             f"has_min={self.has_min}")
        row_view(self.qweight)[row_index(row, q.shape[0])] = q.to(torch.int8).reshape(q.shape[0], -1, 4)
        self._scale_rows(row, scales=scales, **({"mins": mins} if self.has_min else {}))

    def load_dense_rows(self, row: int, w: torch.Tensor) -> None:
        """Quantize dense rows ``w`` ``[n, K]`` (round to nearest) into rows ``row ..``."""
        self.load_rows(row, *quantize_int8_rtn(w, self.group_size))

    def _mins(self) -> torch.Tensor | None:
        return self.mins if self.has_min else None

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense rows ``W[rows]`` ``[len(rows), K]``: an embedding lookup from this weight."""
        idx = (rows // TILE, rows % TILE)
        q = row_view(self.qweight)[idx].reshape(len(rows), -1, self.group_size)  # [n, G, group]
        w = q.float() * row_view(self.scales)[idx].float()[..., None]
        if self.has_min:
            w = w + row_view(self.mins)[idx].float()[..., None]
        return w.reshape(len(rows), self.in_features).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[N, K]`` weight in ``dtype`` (computed in fp32)."""
        return self.dequantize_rows(torch.arange(self.out_features, device=self.qweight.device), dtype)


class Int4Linear(_QuantLinear):
    """Weight-only int4 linear with group-wise scales and mins:
    ``W[n, k] = q[n, k] * scale[n, g] + min[n, g]`` (see the module docstring).

    Buffers: ``qweight`` uint8 ``[T, K / 8, 16, 4]`` (two values a byte), ``scales`` and
    ``mins`` ``[T, K / group_size, 16]``.

    Raises:
        ValueError: ``group_size`` does not divide ``in_features``, or ``in_features`` is not a
            multiple of 8.
    """

    SCALE_BUFFERS = ("scales", "mins")

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group_size: int = DEFAULT_INT4_GROUP_SIZE, dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias, group_size, dtype)
        if in_features % 8:
            raise ValueError(f"int4 needs in_features divisible by 8, got {in_features}")
        self.register_buffer("qweight", torch.zeros(num_tiles(out_features), in_features // 8, TILE, 4,
                                                    dtype=torch.uint8))

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int | None = None) -> Int4Linear:
        """Round-to-nearest int4 of a dense ``nn.Linear`` (group size from :func:`int4_group_size`)."""
        g = group_size or int4_group_size(linear.in_features)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, g)
        m.load_rows(0, *quantize_int4_rtn(linear.weight.detach(), g))
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        return m

    def load_rows(self, row: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        """Write rows ``row .. row + len(q)``: ``q`` ``[n, K]`` values 0..15, ``scales`` and
        ``mins`` ``[n, K // group_size]`` (``W = q * scale + min``).

        Raises:
            ValueError: shapes do not match this layer.
        """
        self._check_rows(row, q)
        row_view(self.qweight)[row_index(row, q.shape[0])] = pack_int4_row(q)
        self._scale_rows(row, scales=scales, mins=mins)

    def load_dense_rows(self, row: int, w: torch.Tensor) -> None:
        """Quantize dense rows ``w`` ``[n, K]`` (round to nearest) into rows ``row ..``."""
        self.load_rows(row, *quantize_int4_rtn(w, self.group_size))

    def _mins(self) -> torch.Tensor:
        return self.mins

    def unpacked(self) -> torch.Tensor:
        """``q`` as ``[N, K]`` uint8 values 0..15."""
        return unpack_int4_row(from_tiles(self.qweight, self.out_features))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[N, K]`` weight in ``dtype``: ``q * scale + min`` in fp32 (a multiply, then an add)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        q = self.unpacked().float().view(n, k // g, g)
        s, m = from_tiles(self.scales, n).float(), from_tiles(self.mins, n).float()  # [N, G]
        return (q * s[..., None] + m[..., None]).view(n, k).to(dtype)


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


@torch.library.custom_op("atlas_vlm::quant_linear", mutates_args=())
def quant_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    bias: torch.Tensor | None, out_features: int, group_size: int) -> torch.Tensor:
    """``_QuantLinear.forward``'s kernel path as one op the compiler does not look into:
    ``x`` ``[n, K]`` -> ``[n, out_features]``."""
    return quant_kernel.quant_matmul(x, qweight, scales, mins, out_features, group_size, bias)


@quant_linear_op.register_fake
def _(x, qweight, scales, mins, bias, out_features, group_size):
    return x.new_empty(x.shape[0], out_features)
