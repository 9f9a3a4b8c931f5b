"""Pure input preparation for one engine step: ids, positions, slot mapping, block tables,
the attention layout and which encoder rows (images, videos) land where. No model, no cache: every
function here runs on CPU lists and is tested without weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atlas_vlm.layers.attention import AttentionMetadata, build_attention_metadata
from mm_kv_cache_management import StateMetadata


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64, requests one after another
    positions: torch.Tensor  # [num_tokens] (RoPE) or [3, num_tokens] (M-RoPE) int64
    meta: AttentionMetadata  # slot mapping, block tables, attention mask
    logits_index: torch.Tensor  # [num_sampled] flat index of the last token of each finishing chunk
    sampled: list[int]  # index into the step's chunks of each row of logits_index
    mm_embeds: torch.Tensor | None  # [num_placeholder_tokens_in_step, hidden] rows replacing pad embeddings
    mm_token_index: torch.Tensor | None  # [num_placeholder_tokens_in_step] flat token index of each row
    lora_slots: list[int] | None = None  # [num_tokens] each row's LoRA slot (-1: none); None: LoRA off


def mm_rows_for_chunk(ranges, encoder_outputs, start: int, end: int):
    """Encoder rows that fall in tokens ``start .. end-1`` of one request.

    Args:
        ranges: the request's ``PlaceholderRange`` list (offset, length, content_hash,
            embed_offset), sorted by offset.
        encoder_outputs: mapping content hash -> that item's ``[num_tokens, columns]`` encoder
            rows (the runner's ``encoder_outputs``).

    Returns:
        list of ``(first token index within the chunk, rows [n, hidden])``; a chunk boundary
        inside a placeholder run takes the matching slice of that item's rows (case C13),
        and run ``k`` of a many-run item (a Qwen3-VL video) its own rows.

    Raises:
        ValueError: a run in the chunk whose item has no rows (a bug upstream, never ignored).
    """
    out = []
    for r in ranges:
        lo, hi = max(start, r.offset), min(end, r.end)
        if lo < hi:
            emb = encoder_outputs.get(r.content_hash)
            if emb is None:
                raise ValueError(f"{r.modality} item {r.item_index} at tokens {r.offset}..{r.end - 1} has no encoder rows")
            first = r.embed_offset + lo - r.offset
            out.append((lo - start, emb[first:first + hi - lo]))
    return out


def state_metadata(chunks, state_cache, device: torch.device | str = "cpu", snapshot_cache=None) -> StateMetadata:
    """The step's ``StateMetadata`` (hybrid models): each chunk's request's state slot,
    whether the chunk continues a state (it does not start at token 0), the drafts it
    verifies (its request's ``spec_token_ids``: the layers keep a state per row), and, with a
    ``snapshot_cache``, the snapshots each chunk writes (its request's ``snapshot_points``).

    Raises:
        ValueError: a request of the step holds no state slot (a bug upstream, never ignored).
    """
    missing = [req.request_id for req, _ in chunks if req.state_slot is None]
    if missing:
        raise ValueError(f"requests {missing} hold no state slot; a hybrid model's step needs one per request")
    snapshots = None if snapshot_cache is None else \
        [[(k, slot) for k, slot, _ in getattr(req, "snapshot_points", ())] for req, _ in chunks]
    return StateMetadata(state_cache,
                         torch.tensor([req.state_slot for req, _ in chunks], dtype=torch.long, device=device),
                         torch.tensor([req.num_computed_tokens > 0 for req, _ in chunks], dtype=torch.bool,
                                      device=device), snapshots, snapshot_cache,
                         [len(getattr(req, "spec_token_ids", ()) or ()) for req, _ in chunks])


def prepare_inputs(chunks, device: torch.device | str = "cpu", mrope: bool = False,
                   attention_backend: str = "reference", state_cache=None, encoder_outputs=None,
                   snapshot_cache=None) -> ModelInput:
    """Flatten one step's work into model inputs.

    Args:
        chunks: ``(request, num_new_tokens)`` pairs; the request computes tokens
            ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``, whose slots
            its block table already reserves. A chunk that reaches ``request.num_tokens``
            produces logits (its last token is sampled), unless its request is a pooling
            request (``pooling_params`` set: it samples nothing). A request with ``k``
            speculative drafts (``spec_token_ids``, the last ``k`` of its ``token_ids``) gets
            ``k + 1`` rows, its last ``k + 1`` tokens', all with the chunk's index in ``sampled``;
            a chunk of exactly those rows is flagged to the attention layout as verification
            rows (``build_attention_metadata``'s ``verify``: decode rows for the C kernel).
        mrope: the model uses M-RoPE (positions ``[3, num_tokens]``).
        attention_backend: ``EngineConfig.attention_backend`` (the layout the metadata carries).
        state_cache: a hybrid model's ``StateCache``: ``meta.state`` is set (``state_metadata``).
        encoder_outputs: content hash -> encoder rows of every media item the step's chunks
            reach (``mm_rows_for_chunk``); None: no media in the step.
        snapshot_cache: a hybrid's ``StateSnapshotPool.storage`` (prefix caching on), or None.

    Raises:
        ValueError: a chunk outside its request's tokens, or reaching media with no rows.
    """
    ids, positions, slots, tables, q_lens, c_lens, verify = [], [], [], [], [], [], []
    logits_index, sampled, mm_rows, mm_index = [], [], [], []
    base = 0
    for i, (req, n) in enumerate(chunks):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        if n < 1 or end > req.num_tokens:
            raise ValueError(f"request {req.request_id!r}: cannot compute tokens {start}..{end - 1} of {req.num_tokens}")
        ids.extend(req.token_ids[start:end])
        pos = req.positions(start, end)
        positions.append(pos if mrope or pos.dim() == 1 else pos[0])
        slots.extend(req.block_table.slots(start, end))
        tables.append(req.block_table.block_ids)
        q_lens.append(n)
        c_lens.append(end)
        if end == req.num_tokens and getattr(req, "pooling_params", None) is None:  # pooling: no logits
            k = len(getattr(req, "spec_token_ids", ()))  # speculative drafts: the last k + 1 rows
            if k >= n:
                raise ValueError(f"request {req.request_id!r}: a chunk of {n} tokens cannot verify {k} drafts")
            logits_index.extend(range(base + n - 1 - k, base + n))
            sampled.extend([i] * (k + 1))
        verify.append(0 < len(getattr(req, "spec_token_ids", ())) == n - 1 and end == req.num_tokens
                      and getattr(req, "pooling_params", None) is None)
        if req.mm_positions:
            for offset, rows in mm_rows_for_chunk(req.mm_positions, encoder_outputs or {}, start, end):
                mm_rows.append(rows)
                mm_index.extend(range(base + offset, base + offset + rows.shape[0]))
        base += n
    if mrope:
        positions = [p if p.dim() == 2 else p[None].expand(3, -1) for p in positions]
    meta = build_attention_metadata(q_lens, c_lens, slots, tables, device, attention_backend,
                                    verify if any(verify) else None)
    if state_cache is not None:
        meta.state = state_metadata(chunks, state_cache, device, snapshot_cache)
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.cat(positions, dim=-1).to(device),
        meta=meta,
        logits_index=torch.tensor(logits_index, dtype=torch.long, device=device),
        sampled=sampled,
        mm_embeds=torch.cat(mm_rows).to(device) if mm_rows else None,
        mm_token_index=torch.tensor(mm_index, dtype=torch.long, device=device) if mm_rows else None,
    )
