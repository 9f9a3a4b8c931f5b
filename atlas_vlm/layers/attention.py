"""Attention over KV blocks: the one ``paged_attention`` function every layer calls.

Many requests run in one call. Their new tokens arrive flattened (``[num_tokens, ...]``, one
request after another); their K/V are written through ``slot_mapping``, each request's
whole context is gathered through its block table into a padded batch, and SDPA runs once
with a mask that hides padding and future tokens. This is the ``"reference"`` backend; the
``"bucketed"`` backend (``attention_bucketed``, ``EngineConfig.attention_backend``) sits
behind the same function, chosen per step by the metadata, and is tested against it; so does
``"triton"`` (``kernels/triton_attention``: one Triton kernel straight from the blocks,
imported only when chosen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atlas_vlm.config.device import ATTENTION_BACKENDS as SETTING_BACKENDS
from atlas_vlm.kernels import decode_kernel
from atlas_vlm.layers.batch_invariant import per_row_layout
from atlas_vlm.layers.attention_bucketed import (BucketedLayout, block_table_tensor, bucketed_paged_attention,
                                                 build_bucketed_layout)

# the backends a setting names (config.device.ATTENTION_BACKENDS, less "auto"), and batch_invariant
# (deterministic=True); triton: CUDA, or CPU tensors under TRITON_INTERPRET=1
ATTENTION_BACKENDS = (*(b for b in SETTING_BACKENDS if b != "auto"), "batch_invariant")


@dataclass
class AttentionMetadata:
    """Per-step layout of a batch; built once per step by ``atlas_vlm.worker.input_prep``."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with block 0
    context_lens: list[int]  # per request: tokens in cache after this step (old + new)
    query_lens: list[int]  # per request: new tokens this step
    query_index: torch.Tensor  # [num_seqs, max_query_len] int64: flat token of each padded query row
    token_index: torch.Tensor  # [num_tokens] int64: padded row (seq * max_query_len + i) of each token
    attn_mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, max_context_len] bool, True = attend
    bucketed: BucketedLayout | None = None  # set (and attn_mask None) for the "bucketed" backend
    triton: object | None = None  # kernels.triton_attention.TritonLayout for "triton" (attn_mask None)
    # hybrid models only: each sequence's recurrent-state slot (mm_kv_cache_management.StateMetadata)
    state: object | None = None

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)


def choose_attention_backend(requested: str, device_type: str, triton_reason: str | None,
                             decode_kernel_reason: str | None) -> tuple[str, str]:
    """The rule both the engine plan (``engine.plan``) and ``resolve_attention_backend`` apply:
    (backend, why) for ``requested`` given why Triton / the C decode kernel cannot serve (None:
    it can). ``"auto"``: ``"triton"`` on CUDA where it serves, else ``"decode_kernel"`` where
    it serves, else ``"bucketed"``; any other name as asked (a forced backend that cannot
    serve is refused by the caller: ``engine.plan_rules`` / ``resolve_attention_backend``)."""
    if requested == "auto" and device_type == "cuda" and triton_reason is None:
        return "triton", "auto on CUDA: the Triton paged-attention kernel serves this model"
    if requested not in ("auto", "decode_kernel"):
        return requested, f"attention_backend={requested!r} as asked"
    if decode_kernel_reason is None:
        return "decode_kernel", f"{requested}: the C decode kernel serves this model"
    return "bucketed", f"auto: the C decode kernel cannot serve ({decode_kernel_reason})"


def resolve_attention_backend(requested: str, device: torch.device | str, dtype: torch.dtype, num_heads: int,
                              num_kv_heads: int, head_dim: int, kv_cache_dtype: str = "auto") -> str:
    """``EngineConfig.attention_backend`` -> the backend a model runs with
    (``choose_attention_backend`` over this machine's reasons).

    ``"auto"``: ``"triton"`` on CUDA where Triton imports and serves the model (model-dtype
    or 8-bit KV); else ``"decode_kernel"`` where the C decode kernel serves it (CPU, fp32 or bf16,
    sizes in range, a compiler to build it); else ``"bucketed"``. Any other name is kept.

    Raises:
        ValueError: ``"decode_kernel"`` or ``"triton"`` asked for where it cannot serve (the
            reason is named), or an unknown name.
    """
    if requested not in (*ATTENTION_BACKENDS, "auto"):
        raise ValueError(f"attention backend must be 'auto' or one of {ATTENTION_BACKENDS}, got {requested!r}")
    device_type = torch.device(device).type
    triton_why = "not probed"
    if requested == "triton" or (requested == "auto" and device_type == "cuda"):
        triton_why = triton_unsupported_reason(device, dtype, head_dim, kv_cache_dtype)
        if requested == "triton" and triton_why is not None:
            raise ValueError(f"attention_backend='triton' cannot serve this model: {triton_why}")
    kernel_why = None
    if requested in ("auto", "decode_kernel"):
        kernel_why = decode_kernel.unsupported_reason(device, dtype, num_heads, num_kv_heads, head_dim, kv_cache_dtype)
        if requested == "decode_kernel" and kernel_why is not None:
            raise ValueError(f"attention_backend='decode_kernel' cannot serve this model: {kernel_why}")
    return choose_attention_backend(requested, device_type, triton_why, kernel_why)[0]


def triton_unsupported_reason(device, dtype: torch.dtype, head_dim: int, kv_cache_dtype: str) -> str | None:
    """``kernels.triton_attention.unsupported_reason``, or why Triton does not import."""
    try:
        from atlas_vlm.kernels import triton_attention
    except ImportError as e:  # no triton (or a broken one): the PyTorch backends serve
        return f"triton does not import ({e})"
    return triton_attention.unsupported_reason(device, dtype, head_dim, kv_cache_dtype)


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    slot_mapping: list[int],
    block_tables: list[list[int]],
    device: torch.device | str = "cpu",
    backend: str = "reference",
    verify: list[bool] | None = None,
) -> AttentionMetadata:
    """Pure layout math for one step (no model, no cache).

    ``backend``: ``"reference"`` builds the padded query rows and the dense mask below;
    ``"bucketed"`` builds ``attention_bucketed.BucketedLayout`` instead (no dense mask);
    ``"decode_kernel"`` the same layout with the decode requests in one batch for the C
    kernel (``attention_bucketed.DecodeBatch``); ``"batch_invariant"`` (``deterministic=True``)
    every query row in that batch (``layers.batch_invariant.per_row_layout``); ``"triton"``
    the kernel's ``TritonLayout`` (request offsets and lengths, no mask). ``verify``
    (per request, or None): its new tokens are a decode token and its speculative drafts;
    ``"decode_kernel"`` attends each of them as a decode row (``build_bucketed_layout``), the
    other backends as a prefill chunk (the same keys either way).

    Query ``i`` of a request with ``q`` new tokens and ``c`` context tokens sits at absolute
    position ``c - q + i`` and attends keys ``0 .. c - q + i``. Padded query rows attend key
    0 only (so SDPA never sees an all-masked row); their outputs are dropped.

    Raises:
        ValueError: lengths disagree, a request has more new tokens than context, or
            ``backend`` is not one of ``ATTENTION_BACKENDS``.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if not (len(query_lens) == len(context_lens) == len(block_tables)) or sum(query_lens) != len(slot_mapping):
        raise ValueError("query_lens, context_lens, block_tables and slot_mapping disagree in size")
    if any(q < 1 or q > c for q, c in zip(query_lens, context_lens)):
        raise ValueError(f"every request needs 1 <= query_len <= context_len, got {query_lens} / {context_lens}")
    if verify is not None and len(verify) != len(query_lens):
        raise ValueError(f"verify has {len(verify)} flags for {len(query_lens)} requests")
    num_seqs, max_q, max_c = len(query_lens), max(query_lens), max(context_lens)
    starts = torch.tensor([0] + query_lens[:-1]).cumsum(0)  # [num_seqs] first flat token of each request
    q_lens = torch.tensor(query_lens)
    c_lens = torch.tensor(context_lens)
    rows = torch.arange(max_q)  # [max_q]
    valid = rows[None, :] < q_lens[:, None]  # [num_seqs, max_q]
    query_index = torch.where(valid, starts[:, None] + rows[None, :], 0)
    token_index = (torch.arange(num_seqs)[:, None] * max_q + rows[None, :])[valid]  # [num_tokens]
    query_pos = (c_lens - q_lens)[:, None] + rows[None, :]  # [num_seqs, max_q] absolute positions
    mask = bucketed = None
    tables = block_table_tensor(block_tables, device)  # [num_seqs, max_blocks], built once per step
    triton_layout = None
    if backend == "triton":  # no mask, no buckets: the kernel reads the block tables itself
        from atlas_vlm.kernels.triton_attention import build_triton_layout

        triton_layout = build_triton_layout(list(query_lens), list(context_lens), tables)
    elif backend == "batch_invariant":
        bucketed = per_row_layout(list(query_lens), list(context_lens), tables, device)
    elif backend in ("bucketed", "decode_kernel"):
        bucketed = build_bucketed_layout(list(query_lens), list(context_lens), block_tables, device,
                                         decode_kernel=backend == "decode_kernel", tables=tables, verify=verify)
    else:
        keys = torch.arange(max_c)
        mask = keys[None, None, :] <= query_pos[:, :, None]  # [num_seqs, max_q, max_c] causal, within length
        mask &= valid[:, :, None] | (keys == 0)[None, None, :]
        mask = mask[:, None].to(device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        block_tables=tables,
        context_lens=list(context_lens),
        query_lens=list(query_lens),
        query_index=query_index.to(device),
        token_index=token_index.to(device),
        attn_mask=mask,
        bucketed=bucketed,
        triton=triton_layout,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over their requests' cached context.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` new queries (RoPE applied).
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` new keys / values (RoPE applied to k), or
            None when they are already in ``kv_cache`` (``fused.rope_write_kv`` wrote them).
        kv_cache: a ``PagedKVCache`` / ``ContiguousKVCache``, or ``None`` for a cache-free
            full prefill (each request's context is exactly its new tokens).
        layer: decoder layer index into the cache.
        meta: the step's ``AttentionMetadata``; ``meta.bucketed`` selects the bucketed backend.
            A ``worker.compiled_decode.DecodeMeta`` (pure decode, static shapes) attends
            through its one op instead.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    if not isinstance(meta, AttentionMetadata):  # a compiled decode step's static layout
        return meta.attend(q, k, v, kv_cache, layer, scale)  # worker.compiled_decode.DecodeMeta
    num_tokens, num_heads, head_dim = q.shape
    if k is None and kv_cache is None:
        raise ValueError("paged_attention needs k and v without a KV cache")
    if meta.triton is not None:
        from atlas_vlm.kernels.triton_backend import triton_paged_attention

        return triton_paged_attention(q, k, v, kv_cache, layer, meta.triton, meta.slot_mapping, meta.query_index,
                                      scale)
    if meta.bucketed is not None:
        if kv_cache is not None and k is not None:
            kv_cache.write(layer, meta.slot_mapping, k, v)
        return bucketed_paged_attention(q, k, v, kv_cache, layer, meta.bucketed, scale)
    if kv_cache is None:
        if meta.query_lens != meta.context_lens:
            raise ValueError("without a KV cache every request must be a full prefill")
        k_ctx, v_ctx = k[meta.query_index], v[meta.query_index]  # [num_seqs, max_q, kv_heads, head_dim]
    else:
        if k is not None:
            kv_cache.write(layer, meta.slot_mapping, k, v)
        k_ctx, v_ctx = kv_cache.gather_kv_for_attention(layer, meta.block_tables, meta.attn_mask.shape[-1])
        k_ctx, v_ctx = k_ctx.to(q.dtype), v_ctx.to(q.dtype)
    q_pad = q[meta.query_index]  # [num_seqs, max_q, heads, head_dim]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [num_seqs, heads, max_q, head_dim]
        k_ctx.transpose(1, 2),  # [num_seqs, kv_heads, max_ctx, head_dim]
        v_ctx.transpose(1, 2),
        attn_mask=meta.attn_mask,
        scale=scale,
        enable_gqa=num_heads != k_ctx.shape[2],
    )
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [num_seqs * max_q, heads, head_dim]
    return out[meta.token_index]  # [num_tokens, heads, head_dim]
