"""The ``"bucketed"`` attention backend: each request's real tokens, read once.

The reference (``attention.paged_attention``) gathers every request's K/V padded to the
longest context in the step and masks a dense ``[num_seqs, max_q, max_ctx]`` grid. Here the
step is split once (per step, not per layer) into:

- **decode buckets**: requests with one new token, sorted by context length and grouped so
  that a bucket's longest context is at most ``BUCKET_RATIO`` x its shortest (or within
  ``BUCKET_SLACK`` tokens). One SDPA per bucket over its requests' blocks, padded only to
  the bucket's own longest context, with a ``[B, 1, 1, L]`` key-padding mask (none when all
  lengths are equal);
- **prefill chunks**: requests with several new tokens (or a one-token prompt), one SDPA each over exactly their
  context (``is_causal`` when the chunk is the whole context, else a ``[q, c]`` causal mask
  offset by the cached tokens).

The grouping is vLLM's "split decode from prefill" layout (``FlashAttentionMetadata``'s
decode / prefill split) with length buckets in place of a variable-length kernel. The
``"decode_kernel"`` backend builds the same layout with all decode requests in one
``DecodeBatch`` instead of buckets, attended by the C kernel of ``decode_kernel`` straight
from the blocks (no gather, no padding); its prefill chunks are the same, except speculative
verification rows (a decode token and its drafts, flagged by ``verify``): each of those is a
row of the ``DecodeBatch`` too, attending its request's keys up to its own position, so a
drafted step is decode rows only (the one-call C decode step serves it, with these bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atlas_vlm.kernels import decode_kernel

BUCKET_RATIO = 1.25  # longest / shortest context in one decode bucket
BUCKET_SLACK = 64  # tokens of padding always allowed in a bucket (short contexts: few buckets)


@dataclass
class DecodeBucket:
    """Decode requests attended together."""

    token_index: torch.Tensor  # [B] int64: flat token (query row) of each request
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    max_len: int  # longest context in the bucket (tokens)
    pad_mask: torch.Tensor | None  # [B, 1, 1, max_len] bool, True = attend; None: all lengths equal


@dataclass
class DecodeBatch:
    """Every decode request of a step, for the decode kernel."""

    token_index: torch.Tensor  # [D] int64: flat token (query row) of each row, ascending
    block_tables: torch.Tensor  # [D, max_blocks] int64: each row's request's blocks, padded with block 0 (never read)
    context_lens: torch.Tensor  # [D] int64: keys each row attends (its request's, up to and including its own)
    all_tokens: bool = False  # the step is decode only: token_index is 0 .. D-1 (no gather / scatter)


@dataclass
class PrefillChunk:
    """One request with several new tokens."""

    start: int  # first flat token of the chunk
    end: int  # one past its last flat token
    block_table: torch.Tensor  # [1, num_blocks] int64
    context_len: int  # tokens in cache after this step
    causal_mask: torch.Tensor | None  # [q, context_len] bool, True = attend; None: q == context_len


@dataclass
class BucketedLayout:
    decode_buckets: list[DecodeBucket]  # empty when decode_batch is set
    prefills: list[PrefillChunk]
    decode_batch: DecodeBatch | None = None  # the "decode_kernel" backend's decode requests


def decode_groups(context_lens: list[int], ratio: float = BUCKET_RATIO, slack: int = BUCKET_SLACK) -> list[list[int]]:
    """Indices of ``context_lens`` grouped into buckets (each sorted by length).

    A bucket opened at length ``s`` takes every next (sorted) length ``c`` with
    ``c <= max(s * ratio, s + slack)``, so its padding is bounded by either.
    """
    order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        c = context_lens[i]
        if groups and c <= max(context_lens[groups[-1][0]] * ratio, context_lens[groups[-1][0]] + slack):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def block_table_tensor(block_tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[num_seqs, max_blocks]`` int64 of per-request block ids, padded with block 0: one flat
    list into one ``torch.tensor`` (a list of padded rows costs ~3x more on CPU: with paged
    blocks of 16 a batch of 64 requests at 1,024 tokens is 4,096 ids every step)."""
    width = max(len(t) for t in block_tables)
    flat: list[int] = []
    for t in block_tables:
        flat += t
        flat += [0] * (width - len(t))
    return torch.tensor(flat, dtype=torch.long).view(len(block_tables), width).to(device)


def _rows(tables: torch.Tensor, rows: list[int], width: int) -> torch.Tensor:
    """Rows ``rows`` of a ``[num_seqs, max_blocks]`` table tensor, cut to ``width`` blocks."""
    if rows == list(range(tables.shape[0])):
        return tables[:, :width].contiguous()
    return tables.index_select(0, torch.tensor(rows, device=tables.device))[:, :width].contiguous()


def build_bucketed_layout(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                          device: torch.device | str = "cpu", decode_kernel: bool = False,
                          tables: torch.Tensor | None = None, verify: list[bool] | None = None) -> BucketedLayout:
    """Split one step into decode buckets (or, ``decode_kernel``, one ``DecodeBatch``) and
    prefill chunks (lengths already validated by ``attention.build_attention_metadata``).
    ``tables``: ``block_table_tensor(block_tables, device)`` when the caller has it already
    (each bucket's tables are rows of it, not rebuilt from lists). ``verify``: per request,
    its new tokens are speculative verification rows; with ``decode_kernel`` each of them is
    a ``DecodeBatch`` row (row ``r`` of ``q`` attends ``c - q + r + 1`` keys), else ignored."""
    if tables is None:
        tables = block_table_tensor(block_tables, device)
    starts = [0]
    for q in query_lens[:-1]:
        starts.append(starts[-1] + q)
    verify = verify if decode_kernel and verify is not None else [False] * len(query_lens)
    decodes = [i for i, (q, c) in enumerate(zip(query_lens, context_lens)) if (q == 1 and c > 1) or verify[i]]
    buckets, batch = [], None
    if decode_kernel and decodes:
        width = max(len(block_tables[s]) for s in decodes)
        seqs = [s for s in decodes for _ in range(query_lens[s])]  # each row's request
        lens = [context_lens[s] - query_lens[s] + 1 + r for s in decodes for r in range(query_lens[s])]
        batch = DecodeBatch(
            token_index=torch.tensor([starts[s] + r for s in decodes for r in range(query_lens[s])], device=device),
            block_tables=_rows(tables, seqs, width),
            context_lens=torch.tensor(lens, dtype=torch.long, device=device),
            all_tokens=len(seqs) == sum(query_lens))
        decodes = []
    for group in decode_groups([context_lens[i] for i in decodes]):
        seqs = [decodes[g] for g in group]
        lens = torch.tensor([context_lens[s] for s in seqs])  # [B]
        max_len = int(lens.max())
        width = max(len(block_tables[s]) for s in seqs)
        mask = None
        if int(lens.min()) != max_len:
            mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :].to(device)  # [B, 1, 1, L]
        buckets.append(DecodeBucket(token_index=torch.tensor([starts[s] for s in seqs], device=device),
                                    block_tables=_rows(tables, seqs, width),
                                    max_len=max_len, pad_mask=mask))
    prefills = []
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        if (q == 1 and c > 1) or verify[i]:
            continue
        mask = None
        if q != c:  # query row r sits at position c - q + r and sees keys 0 .. c - q + r
            mask = (torch.arange(c)[None, :] <= torch.arange(c - q, c)[:, None]).to(device)  # [q, c]
        prefills.append(PrefillChunk(start=starts[i], end=starts[i] + q, context_len=c, causal_mask=mask,
                                     block_table=tables[i:i + 1, :len(block_tables[i])]))
    return BucketedLayout(decode_buckets=buckets, prefills=prefills, decode_batch=batch)


def _kernel_decode(q: torch.Tensor, kv_cache, layer: int, d, scale: float) -> torch.Tensor:
    """The C decode kernel over one layer of ``kv_cache`` (its 8-bit variant for an 8-bit cache)."""
    k, v, k_scale, v_scale = kv_cache.layer_kv(layer)
    return decode_kernel.paged_decode_attention(q, k, v, d.block_tables, d.context_lens, scale, k_scale, v_scale,
                                                kv_cache.spec.kv_cache_dtype)


def bucketed_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache, layer: int,
                             layout: BucketedLayout, scale: float) -> torch.Tensor:
    """``attention.paged_attention`` over a ``BucketedLayout`` (same arguments and result:
    ``q`` ``[num_tokens, heads, head_dim]``, ``k``/``v`` ``[num_tokens, kv_heads, head_dim]``
    (or None: read from the cache) -> ``[num_tokens, heads, head_dim]``); the new K/V are
    already written to ``kv_cache``.
    ``kv_cache=None``: every request is a full prefill attending only its own new tokens.

    Raises:
        ValueError: ``kv_cache`` is None while a request decodes over cached context.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1] if k is not None else kv_cache.k_cache.shape[-2]
    gqa = num_heads != num_kv_heads
    if kv_cache is None and (layout.decode_buckets or layout.decode_batch is not None):
        raise ValueError("without a KV cache every request must be a full prefill")
    if (d := layout.decode_batch) is not None and d.all_tokens:  # decode only: one kernel call is the answer
        return _kernel_decode(q, kv_cache, layer, d, scale)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if d is not None:
        o = _kernel_decode(q[d.token_index], kv_cache, layer, d, scale)  # [D, heads, head_dim]
        out.index_copy_(0, d.token_index, o)
    for b in layout.decode_buckets:
        k_ctx, v_ctx = kv_cache.gather_kv_for_attention(layer, b.block_tables, b.max_len)  # [B, L, kv_heads, hd]
        num_seqs = b.token_index.numel()
        # The query heads that share a KV head become that head's query rows (query head h reads
        # KV head h // group, as HF's repeat_kv): one plain SDPA, no enable_gqa, which on CPU in
        # bf16 is 5-7x slower for one query row (benchmarks/attention.py).
        o = F.scaled_dot_product_attention(
            q[b.token_index].view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),  # [B, kv, group, hd]
            k_ctx.to(q.dtype).transpose(1, 2),  # [B, kv_heads, L, head_dim]
            v_ctx.to(q.dtype).transpose(1, 2),
            attn_mask=b.pad_mask, scale=scale)  # mask [B, 1, 1, L] broadcasts over kv heads and group rows
        out.index_copy_(0, b.token_index, o.reshape(num_seqs, num_heads, head_dim))  # [B, heads, head_dim]
    for p in layout.prefills:
        if kv_cache is None:
            k_ctx, v_ctx = k[p.start:p.end], v[p.start:p.end]  # [q, kv_heads, head_dim]
        else:
            k_ctx, v_ctx = kv_cache.gather_kv_for_attention(layer, p.block_table, p.context_len)
            k_ctx, v_ctx = k_ctx[0].to(q.dtype), v_ctx[0].to(q.dtype)  # [c, kv_heads, head_dim]
        o = F.scaled_dot_product_attention(
            q[p.start:p.end].transpose(0, 1)[None],  # [1, heads, q, head_dim]
            k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None],  # [1, kv_heads, c, head_dim]
            attn_mask=p.causal_mask, is_causal=p.causal_mask is None, scale=scale, enable_gqa=gqa)
        out[p.start:p.end] = o[0].transpose(0, 1)  # [q, heads, head_dim]
    return out
