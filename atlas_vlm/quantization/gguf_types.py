"""GGUF block formats decoded bit-exactly to our quantized modules' form: integer ``q`` per
weight, a scale (and a min) per group of inputs, ``W = q * scale (+ min)`` in fp32 (a
multiply, then an add), equal to what the ``gguf`` package's ``gguf.quants.dequantize``
gives for every block (its numpy code is the source of each layout; tested bit for bit).

=========  ====================================  =======================================  =====
GGUF type  block (weights: bytes)                ``q``, scale, min                        group
=========  ====================================  =======================================  =====
Q8_0       32: int8 + fp16 ``d``                 int8 ``q``, ``d``                        32
Q4_0       32: nibbles + ``d``                   0..15, ``d``, ``-8 d`` (int8 form:       32
                                                 ``q - 8``, ``d``, no min)
Q4_1       32: nibbles + ``d``, ``m``            0..15, ``d``, ``m``                      32
Q4_K       256: nibbles, 6-bit ``sc``/``m``      0..15, ``d sc``, ``-dmin m``             32
Q5_0       32: 5 bits + ``d``                    ``q - 16`` in -16..15, ``d``             32
Q5_1       32: 5 bits + ``d``, ``m``             0..31, ``d``, ``m``                      32
Q5_K       256: 5 bits, 6-bit ``sc``/``m``       0..31, ``d sc``, ``-dmin m``             32
Q6_K       256: 6 bits, int8 ``sc``              ``q - 32`` in -32..31, ``d sc``          16
Q3_K       256: 3 bits, 6-bit ``sc``             -4..3, ``d (sc - 32)``                   16
Q2_K       256: 2 bits, 4-bit ``sc``/``m``       0..3, ``d sc``, ``-dmin m``              16
IQ4_NL     32: nibbles + ``d``                   ``kvalues[nibble]`` (-127..113), ``d``   32
IQ4_XS     256: nibbles, 6-bit ``sc``            ``kvalues[nibble]``, ``d (sc - 32)``     32
=========  ====================================  =======================================  =====

Scales ``d sc`` are fp32 products (exact: an fp16 times an integer of at most 8 bits), as
the reference computes them; ``d``, ``m`` alone are fp16 values. Q4_0 / Q4_1 / Q4_K run as
``Int4Linear``; every other type (and an int4 type sharing a fused projection with one) as
``Int8Linear`` (``q`` in int8, with mins where a part has them; see :func:`int8_form`).

Bytes held a weight (``weight_bytes``; tiles of 16 rows, scales and mins fp16 where all are
exact in fp16, else fp32): ``Int4Linear`` 0.5 + 2 x 2 / 32 = 0.625; ``Int8Linear`` 1 + (1 or 2)
x (2 or 4) / group, e.g. Q8_0 / Q5_0 1.0625, Q5_K 1.25, Q6_K 1.25 (the file's Q6_K: 0.82),
a group-16 projection with mins 1.5. More than the file for 5- and 6-bit types: exact, not
repacked.
"""

from __future__ import annotations

import numpy as np
import torch

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
GROUP = {"Q6_K": 16, "Q3_K": 16, "Q2_K": 16}  # inputs per scale; 32 for every other type
HAS_MIN = ("Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q2_K")  # a min in int8 form (Q4_0's -8 d folds into q)
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h


def group_of(kind: str) -> int:
    """Inputs per scale of GGUF type ``kind`` in our form (16 or 32)."""
    return GROUP.get(kind, 32)


def _f16(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16).astype(np.float32))


def _t(a: np.ndarray, dtype=np.int8) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).astype(dtype))


def _blocks(data: np.ndarray, nbytes: int) -> tuple[int, np.ndarray]:
    n = data.shape[0]
    return n, data.reshape(n, -1, nbytes)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 values: bytes' low nibbles first, then high (ggml Q4_0 / Q4_1)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 ``qh`` bytes (a little-endian uint32) -> bit ``i`` for value ``i``, 0 or 16."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # [N, B, 1]
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _scale_min_k4(sc_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml ``get_scale_min_k4``)."""
    b = sc_bytes.astype(np.int32)
    lo, mid, hi = b[..., :4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# ---- decoders: rows [N, bytes_per_row] uint8 -> (q [N, K], scales [N, G](, mins [N, G])) ----------

def decode_q8_0(data):
    n, b = _blocks(data, 34)
    return _t(b[..., 2:].view(np.int8)).reshape(n, -1), _f16(b[..., :2]).view(n, -1)


def decode_q4_0(data):
    n, b = _blocks(data, 18)
    d = _f16(b[..., :2]).view(n, -1)
    return _t(_nibbles32(b[..., 2:]), np.uint8).reshape(n, -1), d, -8.0 * d


def decode_q4_1(data):
    n, b = _blocks(data, 20)
    return (_t(_nibbles32(b[..., 4:]), np.uint8).reshape(n, -1), _f16(b[..., :2]).view(n, -1),
            _f16(b[..., 2:4]).view(n, -1))


def decode_q4_k(data):
    n, b = _blocks(data, 144)
    d, dmin = _f16(b[..., :2]).view(n, -1, 1), _f16(b[..., 2:4]).view(n, -1, 1)
    sc, mn = _scale_min_k4(b[..., 4:16])
    qs = b[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 64 values: 32 low nibbles, then 32 high
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1)
    return (_t(q, np.uint8), (d * torch.from_numpy(sc)).reshape(n, -1),
            (-dmin * torch.from_numpy(mn)).reshape(n, -1))


def decode_q5_0(data):
    n, b = _blocks(data, 22)
    q = (_nibbles32(b[..., 6:]) | _high_bits32(b[..., 2:6])).astype(np.int16) - 16
    return _t(q).reshape(n, -1), _f16(b[..., :2]).view(n, -1)


def decode_q5_1(data):
    n, b = _blocks(data, 24)
    q = _nibbles32(b[..., 8:]) | _high_bits32(b[..., 4:8])
    return _t(q).reshape(n, -1), _f16(b[..., :2]).view(n, -1), _f16(b[..., 2:4]).view(n, -1)


def decode_q5_k(data):
    n, b = _blocks(data, 176)
    d, dmin = _f16(b[..., :2]).view(n, -1, 1), _f16(b[..., 2:4]).view(n, -1, 1)
    sc, mn = _scale_min_k4(b[..., 4:16])
    qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)  # bit j: group j
    qs = b[..., 48:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 15).reshape(n, -1, 8, 32) | ((qh & 1) << 4)
    return (_t(q).reshape(n, -1), (d * torch.from_numpy(sc)).reshape(n, -1),
            (-dmin * torch.from_numpy(mn)).reshape(n, -1))


def decode_q6_k(data):
    n, b = _blocks(data, 210)
    ql = b[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = ((ql & 15).reshape(n, -1, 8, 32) | ((qh & 3).reshape(n, -1, 8, 32) << 4)).astype(np.int16) - 32
    sc = torch.from_numpy(b[..., 192:208].view(np.int8).astype(np.float32))  # [N, S, 16]
    return _t(q).reshape(n, -1), (_f16(b[..., 208:210]).view(n, -1, 1) * sc).reshape(n, -1)


def decode_q3_k(data):
    n, b = _blocks(data, 110)
    hmask, qs, scb = b[..., :32], b[..., 32:96], b[..., 96:108]
    lsc = (scb[..., :8, None] >> np.array([0, 4], dtype=np.uint8)).transpose(0, 1, 3, 2).reshape(n, -1, 16)
    hsc = (scb[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 1, 3, 2).reshape(n, -1, 16)
    sc = ((lsc & 15) | ((hsc & 3) << 4)).astype(np.float32) - 32
    ql = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = ql.reshape(n, -1, 8, 32).astype(np.int16) - ((qh ^ 1).astype(np.int16) << 2)
    return _t(q).reshape(n, -1), (_f16(b[..., 108:110]).view(n, -1, 1) * torch.from_numpy(sc)).reshape(n, -1)


def decode_q2_k(data):
    n, b = _blocks(data, 84)
    scb, qs = b[..., :16], b[..., 16:80]
    d, dmin = _f16(b[..., 80:82]).view(n, -1, 1), _f16(b[..., 82:84]).view(n, -1, 1)
    q = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    sc, mn = torch.from_numpy((scb & 15).astype(np.float32)), torch.from_numpy((scb >> 4).astype(np.float32))
    return _t(q).reshape(n, -1), (d * sc).reshape(n, -1), (-dmin * mn).reshape(n, -1)


def decode_iq4_nl(data):
    n, b = _blocks(data, 18)
    q = np.array(IQ4_KVALUES, dtype=np.int8)[_nibbles32(b[..., 2:])]
    return _t(q).reshape(n, -1), _f16(b[..., :2]).view(n, -1)


def decode_iq4_xs(data):
    n, b = _blocks(data, 136)
    d = _f16(b[..., :2]).view(n, -1, 1)
    sh = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)  # [N, S, 1]
    sl = (b[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, -1, 8) & 15
    sh = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    sc = torch.from_numpy((sl | (sh << 4)).astype(np.float32) - 32)
    q = np.array(IQ4_KVALUES, dtype=np.int8)[_nibbles32(b[..., 8:].reshape(n, -1, 8, 16))]
    return _t(q).reshape(n, -1), (d * sc).reshape(n, -1)


DECODERS = {"Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q4_K": decode_q4_k,
            "Q5_0": decode_q5_0, "Q5_1": decode_q5_1, "Q5_K": decode_q5_k, "Q6_K": decode_q6_k,
            "Q3_K": decode_q3_k, "Q2_K": decode_q2_k, "IQ4_NL": decode_iq4_nl, "IQ4_XS": decode_iq4_xs}
for _kind, _fn in DECODERS.items():
    _fn.__doc__ = (f"{_kind} rows ``[N, bytes a row]`` uint8 -> ``q`` ``[N, K]``, ``scales`` fp32 "
                   f"``[N, K / {group_of(_kind)}]``{', mins' if _kind in HAS_MIN + ('Q4_0',) else ''} "
                   f"(``W = q * scale{' + min' if _kind in HAS_MIN + ('Q4_0',) else ''}``; see the module docstring).")


def int8_form(kind: str, data: np.ndarray, group: int, with_min: bool):
    """GGUF rows of ``kind`` as an ``Int8Linear`` of ``group`` inputs a scale (16 or 32, at most
    the type's own group) with or without mins: ``q`` int8 ``[N, K]``, ``scales`` (``mins``)
    fp32 ``[N, K / group]`` (a coarser group's scale repeated; zero mins where the type has
    none; Q4_0 as ``q - 8`` and no min), the same ``W`` value for value.

    Raises:
        ValueError: ``group`` is finer than the type allows, or ``kind`` needs mins and
            ``with_min`` is False.
    """
    if group_of(kind) % group:
        raise ValueError(f"GGUF {kind} has a scale per {group_of(kind)} inputs; cannot take group {group}")
    if kind in HAS_MIN and not with_min:
        raise ValueError(f"GGUF {kind} has mins; its Int8Linear needs mins")
    q, scales, *mins = DECODERS[kind](data)
    if kind == "Q4_0":
        q, mins = q.to(torch.int16) - 8, []
    reps = group_of(kind) // group
    scales = scales.repeat_interleave(reps, dim=1)
    out = [q.to(torch.int8), scales]
    if with_min:
        out.append(mins[0].repeat_interleave(reps, dim=1) if mins else torch.zeros_like(scales))
    return tuple(out)
