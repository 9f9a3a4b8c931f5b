"""``Scheduler``: which requests compute which tokens in the next step.

One token budget per step (``max_num_batched_tokens``) is shared by running requests
(decodes and unfinished prefill chunks) first, then waiting requests in arrival order,
whose whole prompt's blocks are reserved at admission. When a decode needs a block and none
is free, the newest running request is preempted by recompute: it gives back its blocks
and returns to the front of the waiting queue (vLLM's policy).

After the forward, ``update_from_output`` moves every scheduled request on (through the
``BlockManager``, the only writer of allocation state), appends the sampled tokens and
finishes requests on EOS, a stop token, ``max_tokens`` or ``max_model_len`` (vLLM
``Scheduler.update_from_output`` / ``check_stop``); stop strings are the output processor's.

Media items share a second budget per step, in encoder rows (``max_num_encoder_tokens``, as
vLLM v1's ``encoder_compute_budget``): a prefill chunk that would reach an item not yet in
the encoder cache counts its rows; when they do not fit, the chunk ends before that item's
first placeholder (the item waits for a later step). An item larger than the whole budget
still runs, alone in its step, so nothing starves. The ``EncoderCacheManager`` beside the
scheduler (``encoder_cache``) knows which items the runner holds and which requests need
them; ``SchedulerOutput.encoder_inputs`` tells the runner what to encode this step and
``freed_encoder_hashes`` what to drop (``engine.encoder_scheduling``).

With a ``StructuredOutputManager`` (the owner of grammar state), a request whose grammar
compiles off the engine thread waits in ``WAITING_FOR_FSM``: ``schedule`` skips it (holding
no block; the requests behind it go on) until the manager has it ready, and fails it alone
("error", in ``SchedulerOutput.failed``) if the compile failed. ``schedule`` asks it for the
step's token bitmask, ``update_from_output`` hands it every accepted token (a grammar that
ends stops its request with "stop"), and ``finish`` tells it the request is gone.

With a draft ``proposer`` (speculative decoding, ``atlas_vlm.spec_decode``), a decoding request's
step carries its last sampled token plus up to ``num_speculative_tokens`` drafts; after the
forward the accepted ones are taken one by one exactly as plain decodes would be, the rest
rolled back (``spec_decode.scheduling``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from atlas_vlm.engine.encoder_cache_manager import EncoderCacheManager
from atlas_vlm.engine.encoder_scheduling import fit_encoder_budget, release_computed_media, schedule_media
from atlas_vlm.engine.plan import SchedulerLimits
from atlas_vlm.request import Request
from atlas_vlm.spec_decode.scheduling import add_drafts, commit_verified, take_verified
from atlas_vlm.worker.sampler import SamplerOutput
from mm_kv_cache_management import BlockManager, NoFreeBlocksError, RequestStatus


@dataclass
class SchedulerOutput:
    chunks: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens this step)
    preempted: list[Request] = field(default_factory=list)  # gave back their blocks this step
    grammar_bitmask: object | None = None  # structured_output.GrammarBitmask of the sampled rows, or None
    failed: list[Request] = field(default_factory=list)  # finished with "error" before running (grammar refused)
    encoder_inputs: dict = field(default_factory=dict)  # content hash -> media item the runner encodes this step
    freed_encoder_hashes: list[str] = field(default_factory=list)  # evicted from the encoder cache: drop their rows

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Waiting and running queues over one ``BlockManager``.

    Args:
        block_manager: the KV blocks to hand out.
        limits: its numbers (``engine.plan.SchedulerLimits``: running requests, tokens and
            encoder rows per step, chunked prefill, drafts per step; the engine passes the
            plan's); ``limit_fields``: any of them by name, over ``limits``.
        eos_token_ids: ids that end a request (unless ``ignore_eos``).
        structured_output_manager: the ``StructuredOutputManager`` of the engine, or None.
        encoder_cache: the ``EncoderCacheManager`` (items cached cost nothing); None: a fresh
            one of ``limits.encoder_cache_tokens`` (0: an item is kept only while a request needs it).
        proposer: a draft proposer (``spec_decode.NgramProposer``) or None (no speculation).
    """

    def __init__(self, block_manager: BlockManager, limits: SchedulerLimits | None = None, *, eos_token_ids=None,
                 structured_output_manager=None, encoder_cache=None, proposer=None, **limit_fields):
        limits = replace(limits or SchedulerLimits(), **limit_fields)
        self.block_manager, self.limits = block_manager, limits
        self.structured_output_manager = structured_output_manager
        self.max_model_len = limits.max_model_len  # None: no limit here (the engine checks at entry)
        self.eos_token_ids = set(eos_token_ids or ())
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.enable_chunked_prefill = limits.enable_chunked_prefill
        self.max_num_encoder_tokens = limits.max_num_encoder_tokens
        self.encoder_cache = encoder_cache if encoder_cache is not None else \
            EncoderCacheManager(limits.encoder_cache_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for tests and benchmarks
        self.proposer, self.num_speculative_tokens = proposer, limits.num_speculative_tokens
        self.speculative_disable_by_batch_size = limits.speculative_disable_by_batch_size
        self.spec_decode_stats = {"drafts": 0, "proposed": 0, "accepted": 0}  # totals (/metrics)

    def add_request(self, req: Request) -> None:
        """Queue ``req``: ``WAITING_FOR_FSM`` while the manager compiles its grammar, else ``WAITING``."""
        compiling = self.structured_output_manager is not None and \
            self.structured_output_manager.is_compiling(req.request_id)
        req.status = RequestStatus.WAITING_FOR_FSM if compiling else RequestStatus.WAITING
        self.waiting.append(req)

    def _collect_compiled(self, out: SchedulerOutput) -> None:
        """Requests whose grammar is ready become ``WAITING``; a failed compile finishes its
        request with "error" (``req.error`` names the field and the library's reason)."""
        for req in [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FSM]:
            ready, error = self.structured_output_manager.poll_compiled(req)
            if error is not None:
                req.error = error
                self.finish(req, "error")
                out.failed.append(req)
            elif ready:
                req.status = RequestStatus.WAITING

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def undo_drafts(self, scheduler_output: SchedulerOutput) -> None:
        """Take the drafts of a step whose forward raised out of their requests' ``token_ids``
        (their slots stay reserved; the next step re-drafts)."""
        for req, _ in scheduler_output.chunks:
            if req.spec_token_ids:
                del req.token_ids[-len(req.spec_token_ids):]
                req.spec_token_ids = []

    def finish(self, req: Request, reason: str | None = None) -> None:
        """Drop a finished or aborted request and free its blocks (idempotent); ``reason``
        sets ``finish_reason`` if given."""
        if reason is not None:
            req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free_request(req)
        self.encoder_cache.free(req.request_id)
        req.status = RequestStatus.FINISHED
        if self.structured_output_manager is not None:
            self.structured_output_manager.remove_request(req.request_id)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free_request(req)  # num_computed_tokens back to 0: recompute
        self.encoder_cache.free(req.request_id)  # its items stay cached until evicted: reused if still there
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self.num_preemptions += 1

    def _reserve_decode_slot(self, req: Request, out: SchedulerOutput) -> bool:
        """Reserve the slot of ``req``'s newest token, preempting newer requests if needed.
        False if ``req`` itself had to be preempted."""
        while True:
            try:
                self.block_manager.decode_append(req)
                return True
            except NoFreeBlocksError:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    return False

    def schedule(self) -> SchedulerOutput:
        """The next step's chunks (and, with structured output, their grammar bitmask)."""
        out = self._schedule()
        out.freed_encoder_hashes = self.encoder_cache.take_freed()
        if self.structured_output_manager is not None and out.chunks:
            out.grammar_bitmask = self.structured_output_manager.grammar_bitmask(out.chunks)
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.structured_output_manager is not None:
            self._collect_compiled(out)
        budget = self.max_num_batched_tokens
        encoder_budget = self.max_num_encoder_tokens or 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1:
                if not self._reserve_decode_slot(req, out):
                    break
                if self.proposer is not None:  # drafts leave one token for each running request after it
                    remaining += add_drafts(self, req, budget - (len(self.running) - i - 1))
            n, cost = fit_encoder_budget(self, req, min(remaining, budget), encoder_budget,
                                         encoder_budget == self.max_num_encoder_tokens)
            i += 1
            if n == 0:
                continue  # its next media item waits for a step with encoder budget left
            schedule_media(self, req, n, out)
            out.chunks.append((req, n))
            budget -= n
            encoder_budget -= cost
        if out.preempted:
            self.block_manager.reserve_snapshots(out.chunks)
            return out
        skipped: list[Request] = []  # grammars still compiling: back at the front, in order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_FSM:
                skipped.append(self.waiting.popleft())
                continue
            if not self.enable_chunked_prefill and req.num_tokens > budget and out.chunks:
                break
            if not self.block_manager.can_allocate(req):
                break
            self.block_manager.prefill_allocate(req)
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget) if self.enable_chunked_prefill else remaining
            n, cost = fit_encoder_budget(self, req, n, encoder_budget, encoder_budget == self.max_num_encoder_tokens)
            if n == 0:  # its first media item does not fit this step's encoder budget
                self.block_manager.free_request(req)
                break
            encoder_budget -= cost
            schedule_media(self, req, n, out)
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            out.chunks.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        self.block_manager.reserve_snapshots(out.chunks)  # hybrid + prefix caching: state snapshots to take
        return out

    # ---- after the forward ------------------------------------------------------------------
    def _check_stop(self, req: Request, token: int, grammar_ended: bool = False) -> str | None:
        params = req.sampling_params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if grammar_ended:
            return "stop"
        if req.num_output_tokens >= req.max_tokens:
            return "length"
        if self.max_model_len is not None and req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _take(self, req: Request, sampled: SamplerOutput, row: int, tokens: list[int]) -> str | None:
        """Append sampler row ``row``'s token to ``req`` (and to ``tokens``) with its logprobs,
        feed it to the grammar; the finish reason it causes ("error" with ``req.error`` if the
        row failed or the grammar refused it; nothing appended for a failed row), else None."""
        token, error = sampled.token_ids[row], sampled.errors[row]
        if error is not None:
            req.error = error
            return "error"
        req.token_ids.append(token)
        tokens.append(token)
        if sampled.logprobs[row] is not None:
            req.logprobs.append(sampled.logprobs[row])
            req.top_logprobs.append(sampled.top_logprobs[row])
        grammar_ended = False
        if self.structured_output_manager is not None:
            grammar_ended, error = self.structured_output_manager.accept_token(req, token)
            if error is not None:
                req.error = error
                return "error"
        return self._check_stop(req, token, grammar_ended)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: tuple[list[int], SamplerOutput]
                           ) -> list[tuple[Request, list[int]]]:
        """Apply one step's results.

        Args:
            scheduler_output: what ``schedule`` returned for the step.
            runner_output: ``(chunk indices of the sampled rows, SamplerOutput)`` from
                ``ModelRunner.run``.

        Returns:
            ``(request, new token ids)`` for every request that sampled a token or finished
            in this step, in row order (several ids: a step's accepted drafts + the target's next), then every pooling request whose prompt is now
            computed (its ``embedding`` from ``SamplerOutput.pooled``; finished with "stop", no token).
            A finished request is out of the queues, its blocks freed and ``finish_reason``
            set ("error" with ``error`` when its row failed).
        """
        for req, n in scheduler_output.chunks:
            if not req.spec_token_ids:  # a step with drafts commits what was accepted (below)
                self.block_manager.commit_computed(req, n)
            release_computed_media(self, req)
        indices, sampled = runner_output
        updates = []
        row = 0
        while row < len(indices):
            req = scheduler_output.chunks[indices[row]][0]
            num_rows = 1 + len(req.spec_token_ids)  # a step with k drafts sampled k + 1 rows
            drafted = num_rows > 1
            rows = take_verified(self, req, sampled, row) if drafted else [row]
            row += num_rows
            tokens, reason = [], None
            for r in rows:
                reason = self._take(req, sampled, r, tokens)
                if reason is not None:
                    break
            if drafted:
                commit_verified(self, req, len(rows))
            if reason is not None:
                self.finish(req, reason)
            updates.append((req, tokens))
        for req, _ in scheduler_output.chunks:  # pooling requests end with their prompt (no decode)
            if req.pooling_params is not None and req.num_computed_tokens == req.num_tokens:
                req.embedding = sampled.pooled.get(req.request_id)
                self.finish(req, "stop")
                updates.append((req, []))
        return updates
