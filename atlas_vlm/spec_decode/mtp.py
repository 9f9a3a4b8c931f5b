"""MTP drafts (``speculative="mtp"``): the checkpoint's multi-token-prediction head proposes.

vLLM's MTP proposer, step by step (``v1/spec_decode/eagle.py`` with ``method="mtp"``): after
each target forward, the MTP layer runs over the same positions with the next tokens (position
``t`` takes the target's hidden state ``h_t`` and token ``x_{t+1}``: the prompt's next token,
or the token the sampler just chose at that row; ``models.qwen3_5.mtp``). That writes its K/V
for every position the target computed (prompt chunks included), at the target's slots. At a
request's newest position (the last verified row taken) its output gives draft 1; drafts
2..k chain the layer on its own output hidden state and draft (``mtp_chain``). Drafts are
greedy (argmax of the shared LM head), kept by ``MTPProposer`` until the scheduler asks for
them before the next step (``propose``, the n-gram proposer's interface), and verified there
as any drafts: the output is exactly the target's. Only one draft is made while every
drafting request of the step is below the acceptance floor (each drafts one at most), none
in a step the scheduler would not draft in (``speculative_disable_by_batch_size``).

A prefix-cache hit must not end at a block whose last MTP K/V used another request's next
token: the engine sets ``BlockManager.drop_last_hit_block`` (vLLM's rule for EAGLE / MTP).

Which rows: a chunk's sampler rows are its last ``k + 1`` positions (``k`` its drafts); the
rows taken are those the scheduler takes (``spec_decode.scheduling.take_verified``: while the
row's token equals the draft), so the newest position is the first row that differs, or the last.
Positions after it get the K/V of rejected guesses, which the next step overwrites before any
real query reads them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from atlas_vlm.spec_decode import scheduling
from atlas_vlm.spec_decode.mtp_chain import ChainKV, chain_metadata

__all__ = ["MTPDrafter", "MTPProposer"]


class MTPProposer:
    """Holds each request's MTP drafts between the step that made them and the scheduler's
    ``propose`` (an LRU of ``capacity`` requests: a request not stepped for long loses its
    drafts, nothing else).

    Args:
        placeholder_token_ids: ids never proposed (image / video pads): drafts stop before one.
        capacity: requests whose drafts are kept at most.
    """

    def __init__(self, placeholder_token_ids: Iterable[int] = (), capacity: int = 1024):
        self.placeholder_token_ids = set(placeholder_token_ids)
        self.capacity = capacity
        self._drafts: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()

    def store(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Keep ``drafts`` for ``request_id``, valid while it has ``num_tokens`` tokens."""
        self._drafts.pop(request_id, None)
        self._drafts[request_id] = (num_tokens, drafts)
        while len(self._drafts) > self.capacity:
            self._drafts.popitem(last=False)

    def propose(self, token_ids: Sequence[int], k: int, media_ranges: Iterable = (),
                request_id: str | None = None) -> list[int]:
        """Up to ``k`` drafts to follow ``token_ids`` (the request's tokens so far): the MTP's
        drafts made when the request reached this length, cut before a placeholder id; none
        when there are none for this length (a preempted or unknown request)."""
        num, drafts = self._drafts.get(request_id, (-1, []))
        if k <= 0 or num != len(token_ids):
            return []
        out = []
        for t in drafts[:k]:
            if t in self.placeholder_token_ids:
                break
            out.append(t)
        return out


class MTPDrafter:
    """Runs the MTP head after each target forward and stores the drafts (``proposer``).

    Args:
        model: the target (``embed``, ``compute_logits``, ``model.rotary``).
        mtp: the MTP head (``models.qwen3_5.mtp.Qwen3_5MTP``).
        num_speculative_tokens: drafts made per request (``k``).
        proposer: where drafts are kept.
        disable_by_batch_size: a step of more requests than this makes no drafts (the
            scheduler would not take them: ``speculative_disable_by_batch_size``); its MTP K/V
            are still written. None: drafts at any batch size.
    """

    def __init__(self, model, mtp, num_speculative_tokens: int, proposer: MTPProposer,
                 disable_by_batch_size: int | None = None):
        self.model, self.mtp, self.k, self.proposer = model, mtp, num_speculative_tokens, proposer
        self.disable_by_batch_size = disable_by_batch_size
        self.num_draft_steps = 0  # MTP passes run (real pass + chained steps), for measurements

    def _embed_and_rope(self, ids: torch.Tensor, positions: torch.Tensor, dtype):
        if positions.dim() == 1:
            positions = positions[None].expand(3, -1)  # [3, num_tokens] text M-RoPE
        cos, sin = self.model.model.rotary(positions, dtype)
        return self.model.embed(ids), cos, sin

    @torch.inference_mode()
    def after_step(self, chunks, inp, hidden: torch.Tensor, sampled_chunks: list[int], out, kv_cache,
                   inputs_embeds: torch.Tensor | None = None) -> None:
        """One MTP pass over the step's positions, then drafts for every request whose chunk
        sampled.

        Args:
            chunks: the step's ``(request, num_tokens)`` (``num_computed_tokens`` and
                ``spec_token_ids`` as the step ran them).
            inp: the step's ``ModelInput`` (positions, attention metadata).
            hidden: the target's output hidden states ``[num_tokens, hidden]``.
            sampled_chunks: the chunk index of each sampler row; ``out``: the ``SamplerOutput``.
            kv_cache: the engine's cache (the MTP's layer included).
            inputs_embeds: the target's input embeddings ``[num_tokens, hidden]`` (media rows
                in place): a prompt position whose next token is in the same chunk takes that
                token's row (an image row, not its placeholder's embedding), as vLLM shifts them.
        """
        rows_of: dict[int, list[int]] = {}
        for row, i in enumerate(sampled_chunks):
            rows_of.setdefault(i, []).append(row)
        next_ids, last_index, drafting, shifted = [], [], [], []  # shifted: positions whose next row is in the chunk
        base = 0
        for i, (req, n) in enumerate(chunks):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            rows = rows_of.get(i)
            if rows is None:  # mid-prompt (or a pooling request): the prompt's next tokens
                nxt = list(req.token_ids[start + 1:end + 1])
                next_ids += nxt + [0] * (n - len(nxt))
                shifted += range(base, base + n - 1)
            else:
                k = len(rows) - 1
                taken = [out.token_ids[r] if out.errors[r] is None else 0 for r in rows]
                next_ids += list(req.token_ids[start + 1:end - k]) + taken
                shifted += range(base, base + n - 1 - k)
                drafts = list(req.spec_token_ids) if k else []
                a = 0  # drafts accepted: the rows take_verified takes
                while a < k and out.errors[rows[a]] is None and taken[a] == drafts[a]:
                    a += 1
                if out.errors[rows[a]] is None:
                    last_index.append(base + n - 1 - k + a)
                    drafting.append((i, req, end - k + a))  # positions with real MTP K/V
            base += n
        ids = torch.tensor(next_ids, dtype=torch.long, device=hidden.device)
        embeds, cos, sin = self._embed_and_rope(ids, inp.positions, hidden.dtype)
        if inputs_embeds is not None and inp.mm_embeds is not None and shifted:  # text rows are equal anyway
            dst = torch.tensor(shifted, device=embeds.device)
            embeds[dst] = inputs_embeds[dst + 1].to(embeds.dtype)
        h = self.mtp(embeds, hidden, cos, sin, kv_cache, inp.meta)  # [num_tokens, hidden]
        self.num_draft_steps += 1
        limit = self.disable_by_batch_size
        if not drafting or self.k < 1 or (limit is not None and len(chunks) > limit):
            return
        h = h[torch.tensor(last_index, device=h.device)]  # [num_drafting, hidden]
        tokens = [self.model.compute_logits(h).argmax(-1)]  # draft 1 of each request
        # chained drafts only for a request that will draft more than one: below the acceptance
        # floor it drafts one at most (a probe, spec_decode.scheduling.draft_limit)
        steps = self.k if any(req.spec_acceptance >= scheduling.ACCEPTANCE_FLOOR for _, req, _ in drafting) else 1
        if steps > 1:
            tables = inp.meta.block_tables[torch.tensor([i for i, _, _ in drafting], device=h.device)]
            chain = ChainKV(kv_cache, tables, [length for _, _, length in drafting])
            for step in range(1, steps):
                pos = [req.positions(length - 1 + step, length + step) for _, req, length in drafting]
                pos = torch.cat([p if p.dim() == 2 else p[None].expand(3, -1) for p in pos], dim=1)  # [3, n]
                embeds, cos, sin = self._embed_and_rope(tokens[-1], pos.to(h.device), h.dtype)
                h = self.mtp(embeds, h, cos, sin, chain, chain_metadata(chain, step, h.device))
                self.num_draft_steps += 1
                tokens.append(self.model.compute_logits(h).argmax(-1))
        drafts = torch.stack(tokens, dim=1).tolist()  # [num_drafting, k]
        for (_, req, length), d in zip(drafting, drafts):
            self.proposer.store(req.request_id, length + 1, d)


def build_drafter(model, config, kv_layer: int, model_name: str,
                  placeholder_token_ids: Iterable[int] = ()) -> MTPDrafter:
    """The ``MTPDrafter`` of a loaded target for ``EngineConfig`` ``config``; its MTP layer
    reads and writes cache layer ``kv_layer`` (the one after the target's own); media
    placeholder ids are never proposed.

    Raises:
        ValueError: the model has no MTP head (only Qwen3.5 checkpoints carry ``mtp.*``), or
            its checkpoint lacks the weights (``models.qwen3_5.mtp.build_mtp``; both name
            ``model_name``).
    """
    if not model.capabilities().mtp:
        raise ValueError(f"speculative='mtp' needs a model with a multi-token-prediction head (Qwen3.5's mtp.*); "
                         f"{model_name} ({type(model).__name__}) has none; use speculative='ngram'")
    from atlas_vlm.models.qwen3_5.mtp import build_mtp

    mtp = build_mtp(model, kv_layer, model_name)
    proposer = MTPProposer(placeholder_token_ids, capacity=4 * config.scheduler_config.max_num_seqs + 16)
    return MTPDrafter(model, mtp, config.speculative_config.speculative_tokens, proposer,
                       config.speculative_config.disable_by_batch_size)
