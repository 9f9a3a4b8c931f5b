"""A fused decode step: pure-decode engine steps through a ``torch.compile``d forward, one
compiled graph per batch-size bucket (``EngineConfig.compile_decode``).

Shape of the step (static, so that a CUDA graph could capture it as well):

- a step whose chunks are all one-token decodes that sample (no prefill, no media rows) is
  padded to the next bucket ``B`` of ``BUCKETS`` (capped at ``max_num_seqs``); the padding rows
  are copies of row 0 (same token, position, block table and context length), so they compute
  what row 0 computes, read only valid cache, and their K/V writes go to row 0's slot with row
  0's own K/V bits (``write_rows``): the cache ends up exactly as without them;
- inputs live in static per-bucket buffers (``_Buffers``: ``[B]`` ids, positions, slots,
  context lengths, ``[B, max_blocks]`` block tables with ``max_blocks = ceil(max_model_len /
  block_size)``), filled in place each step; only their values change, so the compiled graph
  is reused without guards failing (``dynamic=False``: nothing is marked dynamic);
- attention is one opaque op per layer, ``atlas_vlm::decode_attention`` (a
  ``torch.library.custom_op`` that writes the new K/V into the cache and attends from the
  blocks: the C decode kernel where it serves, else a gather + masked SDPA over the block
  table), so the compiler fuses everything around it (norms, RoPE, SwiGLU, residuals) and
  never sees the cache layout; it holds no host sync.

The eager path (``ModelRunner.forward_logits`` through ``prepare_inputs`` and
``paged_attention``) stays the reference and the fallback: any step that is not pure decode,
and every step after a compile or run failure (logged once, then the engine stays eager),
runs eager. Tested: greedy tokens and logits equal the eager path on tiny models
(``tests/engine/test_compiled_decode.py``).

Whether ``"auto"`` turns it on: ``resolve_compile_decode``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atlas_vlm.kernels import decode_kernel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # padded batch sizes, one compiled graph each


def batch_bucket(num_seqs: int, max_num_seqs: int) -> int:
    """The padded batch size of a step of ``num_seqs`` decodes: the smallest bucket >=
    ``num_seqs``; above the largest bucket (or when ``max_num_seqs`` is below a bucket),
    ``max(num_seqs, max_num_seqs)``-capped sizes are their own bucket."""
    for b in BUCKETS:
        if b >= num_seqs:
            return b if b <= max_num_seqs else max(num_seqs, max_num_seqs)
    return num_seqs


# ---- the attention op ------------------------------------------------------------------------
def _attend_reference(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Gather each row's blocks (the whole table width) and run masked SDPA.

    ``q`` ``[B, heads, hd]``; caches ``[num_blocks, block_size, kv_heads, hd]`` (one layer);
    ``block_tables`` ``[B, max_blocks]``; ``context_lens`` ``[B]`` -> ``[B, heads, hd]``.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(num_seqs, -1, kvh, head_dim).to(q.dtype)  # [B, L, kvh, hd]
    v = v_cache.index_select(0, flat).view(num_seqs, -1, kvh, head_dim).to(q.dtype)
    keys = torch.arange(k.shape[1], device=q.device)
    mask = (keys[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(
        q.view(num_seqs, kvh, num_heads // kvh, head_dim), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, scale=scale)  # [B, kvh, group, hd]
    return o.reshape(num_seqs, num_heads, head_dim)


@torch.library.custom_op("atlas_vlm::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor, write_rows: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     use_kernel: bool) -> torch.Tensor:
    """Write one decode step's K/V and attend, for one layer.

    Args:
        q: ``[B, heads, hd]`` (RoPE applied); k, v: ``[B, kv_heads, hd]``.
        k_cache, v_cache: the whole cache ``[num_layers, num_blocks, block_size, kv_heads, hd]``
            (written in place at ``layer``).
        slot_mapping: ``[B]`` int64 flat slot of each row's new token.
        write_rows: ``[B]`` int64: row ``i`` writes the K/V of row ``write_rows[i]`` (``i`` for a
            real row, 0 for a padding row, whose slot is row 0's: the same bits land twice).
        block_tables: ``[B, max_blocks]`` int64; context_lens: ``[B]`` int64 (new token included).
        use_kernel: attend with the C decode kernel (else gather + masked SDPA).

    Returns:
        ``[B, heads, hd]`` in ``q``'s dtype.
    """
    kvh, hd = k_cache.shape[-2], k_cache.shape[-1]
    k_w, v_w = k.index_select(0, write_rows), v.index_select(0, write_rows)
    k_cache[layer].view(-1, kvh, hd).index_copy_(0, slot_mapping, k_w.to(k_cache.dtype))
    v_cache[layer].view(-1, kvh, hd).index_copy_(0, slot_mapping, v_w.to(v_cache.dtype))
    if use_kernel:
        return decode_kernel.paged_decode_attention(q, k_cache[layer], v_cache[layer], block_tables,
                                                    context_lens, scale)
    return _attend_reference(q, k_cache[layer], v_cache[layer], block_tables, context_lens, scale)


@decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, layer, slot_mapping, write_rows, block_tables, context_lens, scale, use_kernel):
    return torch.empty_like(q)


@dataclass
class DecodeMeta:
    """What ``attention.paged_attention`` needs for a compiled decode step (in place of an
    ``AttentionMetadata``): tensors only, all of the bucket's static shapes."""

    slot_mapping: torch.Tensor  # [B] int64
    write_rows: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] int64
    use_kernel: bool

    def attend(self, q, k, v, kv_cache, layer: int, scale: float) -> torch.Tensor:
        return torch.ops.atlas_vlm.decode_attention(q, k, v, kv_cache.k_cache, kv_cache.v_cache, layer,
                                                    self.slot_mapping, self.write_rows, self.block_tables,
                                                    self.context_lens, scale, self.use_kernel)


# ---- capability ------------------------------------------------------------------------------
@functools.cache
def inductor_available() -> str | None:
    """None where ``torch.compile``'s inductor backend builds and runs a small CPU graph here
    (a C++ compiler and its headers work), else the reason. Tried once per process (a few
    seconds the first time; inductor caches the build on disk)."""
    try:
        fn = torch.compile(lambda x: torch.relu(x * 2.0 + 1.0).sum(-1), backend="inductor", dynamic=False)
        x = torch.arange(8.0).view(2, 4) - 3
        if not torch.equal(fn(x), torch.relu(x * 2.0 + 1.0).sum(-1)):
            return "a compiled test graph gave a wrong answer"
    except Exception as e:  # noqa: BLE001 - any failure means: no compiler here
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return None


def resolve_compile_decode(requested, device: torch.device | str, kv_cache_dtype: str = "auto") -> tuple[bool, str]:
    """``EngineConfig.compile_decode`` -> (on, why).

    ``True`` / ``False``: as asked (``True`` where inductor cannot build runs eager, logged;
    so does any request with an 8-bit ``kv_cache_dtype``: the compiled step writes K/V in the
    model dtype).
    ``"auto"``: on for CUDA where inductor works, off on CPU: measured on this project's
    AVX512-BF16 CPU with SmolLM2-135M (``benchmarks/compiled_decode.py``,
    docs/performance-quantized.md), the compiled step did not pay (see the figures there), so CPU stays on
    the eager path unless asked.
    """
    dev = torch.device(device)
    if requested is False:
        return False, "compile_decode=False"
    if kv_cache_dtype != "auto":
        return False, f"kv_cache_dtype={kv_cache_dtype}: the compiled step stores K/V in the model dtype; decode runs eager"
    if requested == "auto" and dev.type == "cpu":
        return False, "auto: off on CPU (the compiled step does not pay there, docs/performance-quantized.md)"
    why_not = inductor_available()
    if why_not is not None:
        return False, f"torch.compile's inductor does not work here ({why_not}); decode runs eager"
    return True, "compile_decode=True" if requested is True else f"auto: on ({dev.type}, inductor works)"


# ---- the compiled step -----------------------------------------------------------------------
class _Buffers:
    """Static inputs of one bucket (filled in place each step)."""

    def __init__(self, bucket: int, max_blocks: int, mrope: bool, device):
        self.input_ids = torch.zeros(bucket, dtype=torch.long, device=device)  # [B]
        self.positions = torch.zeros((3, bucket) if mrope else (bucket,), dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(bucket, dtype=torch.long, device=device)  # [B]
        self.write_rows = torch.zeros(bucket, dtype=torch.long, device=device)  # [B]
        self.block_tables = torch.zeros(bucket, max_blocks, dtype=torch.long, device=device)  # [B, max_blocks]
        self.context_lens = torch.ones(bucket, dtype=torch.long, device=device)  # [B]


def _step(input_ids, positions, slot_mapping, write_rows, block_tables, context_lens, use_kernel: bool):
    """Embed -> decoder -> norm -> fp32 logits ``[B, vocab]`` for one padded decode batch.
    ``MODEL`` and ``KV_CACHE`` are globals of each compiled copy of this function (so that
    torch.compile's freezing sees the weights as the graph constants it folds)."""
    meta = DecodeMeta(slot_mapping, write_rows, block_tables, context_lens, use_kernel)
    x = MODEL.embed(input_ids)  # noqa: F821 - set per copy, see CompiledDecode._graph
    hidden = MODEL(x, positions, KV_CACHE, meta)  # noqa: F821
    return MODEL.compute_logits(hidden)  # noqa: F821


class CompiledDecode:
    """Runs pure-decode steps through one compiled graph per batch bucket.

    Args:
        model: the runner's ``CausalLM``; kv_cache: its ``PagedKVCache`` / ``ContiguousKVCache``.
        block_size: tokens per block (the contiguous cache: ``max_model_len``, one strip).
        max_model_len: tokens per request (sets the static block-table width).
        max_num_seqs: the largest batch (caps the buckets).
        mrope: positions are ``[3, B]``.
        use_kernel: the attention op uses the C decode kernel.
    """

    def __init__(self, model, kv_cache, block_size: int, max_model_len: int, max_num_seqs: int, mrope: bool,
                 use_kernel: bool):
        self.model, self.kv_cache, self.mrope, self.use_kernel = model, kv_cache, mrope, use_kernel
        self.max_num_seqs = max_num_seqs
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.device = kv_cache.k_cache.device
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[int, object] = {}  # bucket -> compiled callable
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds of its first (compiling) call
        self.num_compiled_steps = 0  # steps that ran compiled
        self.failed: str | None = None  # set on the first failure; every later step runs eager

    @staticmethod
    def applies(chunks, takes_mm_in_forward: bool = False) -> bool:
        """Whether a step is pure decode: every chunk one new token that is sampled, no media rows."""
        if not chunks or takes_mm_in_forward:
            return False
        for req, n in chunks:
            if n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
                return False
            if any(r.offset <= req.num_computed_tokens < r.end for r in req.mm_positions):
                return False
        return True

    def _graph(self, bucket: int):
        if bucket not in self.graphs:
            # a fresh code object per (runner, bucket): dynamo's cache and recompile limit are per
            # code object, so buckets and engines never evict each other's graph
            code = _step.__code__.replace(co_name=f"decode_step_b{bucket}_{id(self):x}")
            fn = types.FunctionType(code, {**_step.__globals__, "MODEL": self.model, "KV_CACHE": self.kv_cache},
                                    code.co_name)
            self.graphs[bucket] = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True,
                                               options={"freezing": True})
            self.buffers[bucket] = _Buffers(bucket, self.max_blocks, self.mrope, self.device)
        return self.graphs[bucket], self.buffers[bucket]

    def fill(self, chunks, buf: _Buffers) -> None:
        """Write one step's values into a bucket's buffers (rows past the batch copy row 0)."""
        n, bucket = len(chunks), buf.input_ids.shape[0]
        ids, pos, slots, lens, tables = [], [], [], [], []
        for req, _ in chunks:
            t = req.num_computed_tokens
            ids.append(req.token_ids[t])
            p = req.positions(t, t + 1)  # [1] or [3, 1]
            pos.append(p if self.mrope or p.dim() == 1 else p[0])
            slots.append(req.block_table.slot(t))
            lens.append(t + 1)
            tables.append(req.block_table.block_ids)
        pad = bucket - n
        rows = list(range(n)) + [0] * pad
        buf.input_ids.copy_(torch.tensor([ids[r] for r in rows]))
        p = torch.cat(pos, dim=-1)
        if self.mrope and p.dim() == 1:
            p = p[None].expand(3, -1)
        buf.positions.copy_(torch.cat([p, p[..., :1].expand(*p.shape[:-1], pad)], dim=-1) if pad else p)
        buf.slot_mapping.copy_(torch.tensor([slots[r] for r in rows]))
        buf.write_rows.copy_(torch.tensor(rows))
        buf.context_lens.copy_(torch.tensor([lens[r] for r in rows]))
        width = self.max_blocks
        flat = []
        for r in rows:
            t = tables[r]
            flat.extend(t[:width])
            flat.extend([0] * (width - len(t)))
        buf.block_tables.copy_(torch.tensor(flat, dtype=torch.long).view(bucket, width))

    def run(self, chunks) -> torch.Tensor | None:
        """fp32 logits ``[len(chunks), vocab]`` of a pure-decode step, or None where this step
        must run eager (a failure: logged once, then every later step is eager)."""
        if self.failed is not None:
            return None
        n = len(chunks)
        bucket = batch_bucket(n, self.max_num_seqs)
        try:
            graph, buf = self._graph(bucket)
            self.fill(chunks, buf)
            first = bucket not in self.compile_seconds
            start = time.perf_counter()
            logits = graph(buf.input_ids, buf.positions, buf.slot_mapping,
                           buf.write_rows, buf.block_tables, buf.context_lens, self.use_kernel)
            if first:
                self.compile_seconds[bucket] = time.perf_counter() - start
                log.info("compiled the decode step for batch bucket %d in %.1f s", bucket,
                         self.compile_seconds[bucket])
        except Exception as e:  # noqa: BLE001 - any compile/run failure: eager from now on
            self.failed = f"{type(e).__name__}: {str(e).strip()[:300]}"
            log.warning("the compiled decode step failed; decoding eagerly from now on: %s", self.failed)
            return None
        self.num_compiled_steps += 1
        self._last = (buf, n)
        return logits[:n]

    def model_input(self, chunks):
        """The ``ModelInput`` observers see for the step just run: ids and positions of its
        ``len(chunks)`` real rows, every row sampled; ``meta`` is None (no ``AttentionMetadata``)."""
        from atlas_vlm.worker.input_prep import ModelInput

        buf, n = self._last
        return ModelInput(input_ids=buf.input_ids[:n].clone(), positions=buf.positions[..., :n].clone(), meta=None,
                          logits_index=torch.arange(n), sampled=list(range(n)), mm_embeds=None,
                          mm_token_index=None)
