"""Paged attention in Triton: prefill, chunked prefill over a cached prefix and decode rows of
one step in a single kernel launch, straight from the KV blocks (the ``"triton"`` backend).

vLLM's ``triton_unified_attention`` (its 2-D kernel) is the anchor. One program serves one
*query block* of one request (``BLOCK_Q`` consecutive new tokens) and one KV head: its
``BLOCK_M = BLOCK_Q * group`` rows are those tokens times the query heads sharing the KV head
(GQA), so each K/V tile is loaded once per group. Keys are read ``TILE`` at a time through
the request's block table (block ``key // block_size``, row ``key % block_size``); scores,
the running max and sum (online softmax) and the output accumulate in fp32; the output is
written once in the query dtype. A new token at local index ``i`` of a request with ``q``
new and ``c`` total tokens attends keys ``0 .. c - q + i``: the whole cached prefix, causal
within the new tokens. Head dims that are not powers of two (80, 96) are padded to the next
power of two with masks. fp32 inputs multiply in IEEE fp32 (no TF32), so the kernel agrees
with the ``"reference"`` backend to fp32 rounding; fp16 / bf16 use the tensor cores with the
probabilities rounded to the input dtype before ``P @ V`` (as flash attention does).

Which program serves which tokens (``TritonLayout.q_blocks``) is computed on the host once per
step, not searched in the kernel. Under ``TRITON_INTERPRET=1`` (set before ``triton`` is
imported) the same kernel runs on CPU tensors: that is how CI tests it
(``tests/triton_kernels/``). 8-bit KV caches (int8 / fp8_e4m3 codes with a float16 scale per
token and KV head, ``kv_quant``) are read directly: each K / V tile is loaded as codes and
multiplied by its scales in registers (``triton_kv8.dequantize``), in the rotated basis the
codes are stored in; the caller rotates q in and the output back (``triton_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from atlas_vlm.kernels.triton_kv8 import KV_QUANT, dequantize
from mm_kv_cache_management.kv_quant import SCALE_DTYPE, STORAGE_DTYPES

MIN_DOT = 16  # tl.dot's smallest M / N / K on GPUs
TILE = 32  # keys per inner step


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return bool(triton.knobs.runtime.interpret)


def unsupported_reason(device: torch.device | str, dtype: torch.dtype, head_dim: int,
                       kv_cache_dtype: str = "auto") -> str | None:
    """Why this kernel cannot serve a model here, or None when it can.

    It serves CUDA tensors, or CPU tensors under the interpreter; fp32 / fp16 / bf16; head_dim
    up to 256; a KV cache in the model dtype or 8-bit (``kv_quant.KV_CACHE_DTYPES``).
    """
    device = torch.device(device)
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"device {device} (Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1)"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {dtype} (float32, float16 or bfloat16 only)"
    if not 1 <= head_dim <= 256:
        return f"head_dim {head_dim} (1 .. 256 only)"
    if kv_cache_dtype not in KV_QUANT:
        return f"kv_cache_dtype={kv_cache_dtype!r} (one of {tuple(KV_QUANT)} only)"
    return None


def _fp32_dot(dtype: torch.dtype) -> bool:
    """Multiply in IEEE fp32: for fp32 inputs (no TF32), and for bf16 under the interpreter,
    whose ``tl.dot`` multiplies bf16's raw bits (Triton 3.8 stores them as uint16)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


@dataclass
class TritonLayout:
    """One step's layout for the kernel, built once per step (``build_triton_layout``)."""

    query_lens: list[int]  # per request: new tokens this step
    query_start: torch.Tensor  # [num_seqs + 1] int32: first flat token of each request, then the total
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in cache after this step (prefix + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    _q_blocks: dict = field(default_factory=dict)  # block_q -> (seq [n] int32, first query [n] int32)

    def q_blocks(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The program grid's first axis for query blocks of ``block_q`` tokens: each block's
        request and local first query, ``[num_q_blocks]`` int32 each (memoized per step)."""
        if block_q not in self._q_blocks:
            seq = [s for s, n in enumerate(self.query_lens) for _ in range(-(-n // block_q))]
            first = [i * block_q for n in self.query_lens for i in range(-(-n // block_q))]
            dev = self.query_start.device
            self._q_blocks[block_q] = (torch.tensor(seq, dtype=torch.int32, device=dev),
                                       torch.tensor(first, dtype=torch.int32, device=dev))
        return self._q_blocks[block_q]


def build_triton_layout(query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor) -> TritonLayout:
    """``TritonLayout`` of a step: ``query_lens`` / ``context_lens`` per request (new tokens,
    tokens in cache after the step) and their ``[num_seqs, max_blocks]`` block tables."""
    dev = block_tables.device
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return TritonLayout(list(query_lens), torch.tensor(starts, dtype=torch.int32, device=dev),
                        torch.tensor(context_lens, dtype=torch.int32, device=dev), block_tables)


@triton.jit
def _unified_attention_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        q_block_seq_ptr, q_block_first_ptr, scale, block_size, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb,
        stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr, FP32_DOT: tl.constexpr, KV_QUANT: tl.constexpr):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(q_block_seq_ptr + qb)
    q_first = tl.load(q_block_first_ptr + qb)  # local index of this block's first new token
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before the new ones

    offs_m = tl.arange(0, BLOCK_M)  # row = (token in block) * GROUP + (query head in group)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_t = tl.arange(0, TILE_SIZE)
    q_pos = q_first + offs_m // GROUP  # [BLOCK_M] local index of each row's token
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_pos < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_pos).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if FP32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    kv_end = tl.minimum(prefix + q_first + BLOCK_Q, seq_len)  # keys the block's last token sees
    for start in range(0, kv_end, TILE_SIZE):
        key = start + offs_t  # [TILE_SIZE] positions in the request
        key_ok = key < kv_end
        blk = tl.load(block_tables_ptr + seq * stride_bt + key // block_size, mask=key_ok, other=0).to(tl.int64)
        row = (key % block_size).to(tl.int64)
        k = tl.load(k_ptr + blk[None, :] * stride_kb + row[None, :] * stride_ks + kv_head * stride_kh
                    + offs_d[:, None], mask=d_ok[:, None] & key_ok[None, :], other=0.0)  # [HEAD_DIM_PAD, TILE]
        v = tl.load(v_ptr + blk[:, None] * stride_vb + row[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE, HEAD_DIM_PAD]
        if KV_QUANT != 0:  # 8-bit codes: code * its (token, head) scale, in fp32 (exact), rotated basis
            s_off = blk * stride_sb + row * stride_ss + kv_head
            k_s = tl.load(k_scale_ptr + s_off, mask=key_ok, other=0.0).to(tl.float32)  # [TILE]
            v_s = tl.load(v_scale_ptr + s_off, mask=key_ok, other=0.0).to(tl.float32)
            k = (dequantize(k, KV_QUANT) * k_s[None, :]).to(q.dtype)
            v = (dequantize(v, KV_QUANT) * v_s[:, None]).to(q.dtype)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale  # [BLOCK_M, TILE] fp32
        visible = row_ok[:, None] & key_ok[None, :] & (key[None, :] <= prefix + q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing visible yet
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: TritonLayout,
                      scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      kv_cache_dtype: str = "auto", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention of a step's new tokens over their requests' K/V blocks (already written).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, requests one after another as in ``layout``.
        k_cache, v_cache: one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]`` in
            q's dtype, or with ``kv_cache_dtype`` "int8" / "fp8_e4m3" its 8-bit codes
            (``PagedKVCache.layer_kv``), read as ``code * scale``: the rotated basis, so q
            must come rotated (``hadamard_rotate``) and the output is rotated too.
        layout: the step's ``TritonLayout``.
        scale: softmax scale.
        k_scale, v_scale: ``[num_blocks, block_size, num_kv_heads]`` float16, 8-bit caches only.
        out_dtype: the output's dtype (default q's; fp32 accumulators rounded once).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``out_dtype``.

    Raises:
        ValueError: shapes or dtypes disagree (named).
    """
    num_tokens, num_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache / v_cache must be [num_blocks, block_size, kv_heads, {head_dim}], "
                         f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    cache_dtype = q.dtype if kv_cache_dtype == "auto" else STORAGE_DTYPES.get(kv_cache_dtype)
    if cache_dtype is None:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {tuple(STORAGE_DTYPES)}, got {kv_cache_dtype!r}")
    if k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise ValueError(f"the KV cache ({k_cache.dtype}) must be in {cache_dtype} (q {q.dtype}, "
                         f"kv_cache_dtype={kv_cache_dtype!r})")
    quantized = kv_cache_dtype != "auto"
    if quantized and (k_scale is None or v_scale is None or k_scale.shape != k_cache.shape[:3]
                      or v_scale.shape != k_scale.shape or k_scale.stride() != v_scale.stride()
                      or k_scale.dtype != SCALE_DTYPE or v_scale.dtype != SCALE_DTYPE):
        raise ValueError(f"an 8-bit cache needs k_scale / v_scale {tuple(k_cache.shape[:3])} {SCALE_DTYPE} alike, "
                         f"got {None if k_scale is None else (tuple(k_scale.shape), k_scale.dtype)} / "
                         f"{None if v_scale is None else (tuple(v_scale.shape), v_scale.dtype)}")
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if sum(layout.query_lens) != num_tokens:
        raise ValueError(f"q has {num_tokens} tokens, the layout {sum(layout.query_lens)}")
    q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous along head_dim")
    group = num_heads // num_kv_heads
    block_m = max(MIN_DOT, triton.next_power_of_2(group))
    block_q = block_m // group
    q_block_seq, q_block_first = layout.q_blocks(block_q)
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    if q_block_seq.numel() == 0:
        return out
    tables = layout.block_tables
    grid = (q_block_seq.numel(), num_kv_heads)
    k_scale, v_scale = (k_scale, v_scale) if quantized else (k_cache, v_cache)  # unread without 8-bit KV
    _unified_attention_kernel[grid](
        out, q, k_cache, v_cache, k_scale, v_scale, tables, layout.seq_lens, layout.query_start, q_block_seq,
        q_block_first, float(scale), k_cache.shape[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k_scale.stride(0), k_scale.stride(1), tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_SIZE=TILE, FP32_DOT=_fp32_dot(q.dtype),
        KV_QUANT=KV_QUANT[kv_cache_dtype])
    return out
