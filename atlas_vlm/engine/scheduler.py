"""``Scheduler``: which requests compute which tokens in the next step.

One token budget per step (``max_num_batched_tokens``) is shared by running requests
(decodes and unfinished prefill chunks) first, then waiting requests in arrival order,
whose whole prompt's blocks are reserved at admission. When a decode needs a block and none
is free, the newest running request is preempted by recompute: it gives back its blocks
and returns to the front of the waiting queue (vLLM's policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atlas_vlm.request import Request
from mm_kv_cache_management import BlockManager, NoFreeBlocksError, RequestStatus


@dataclass
class SchedulerOutput:
    chunks: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens this step)
    preempted: list[Request] = field(default_factory=list)  # gave back their blocks this step

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Waiting and running queues over one ``BlockManager``.

    Args:
        block_manager: the KV blocks to hand out.
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens computed per step at most.
        enable_chunked_prefill: a prompt may be split across steps; if off, a prompt is
            computed in one step (alone if it is longer than the budget).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for tests and benchmarks

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free_request(req)
        req.status = RequestStatus.FINISHED

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free_request(req)  # num_computed_tokens back to 0: recompute
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
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1 and not self._reserve_decode_slot(req, out):
                break
            n = min(remaining, budget)
            out.chunks.append((req, n))
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.enable_chunked_prefill and req.num_tokens > budget and out.chunks:
                break
            if not self.block_manager.can_allocate(req):
                break
            self.block_manager.prefill_allocate(req)
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget) if self.enable_chunked_prefill else remaining
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            out.chunks.append((req, n))
            budget -= n
        return out
