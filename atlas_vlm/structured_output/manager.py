"""``StructuredOutputManager``: the one owner of every request's grammar state (vLLM v1's
``StructuredOutputManager`` beside the scheduler).

It compiles a request's grammar off the engine thread (vLLM v1: a compile thread pool;
the request waits in ``WAITING_FOR_FSM`` until ``poll_compiled`` finds it ready), builds each step's token bitmask
for the rows that will sample (``grammar_bitmask``; the sampler only applies it), advances
a request's matcher with its accepted token (``accept_token``, called by the scheduler's
``update_from_output``) and forgets the request when the scheduler finishes it. No other
module reads or writes a matcher, and nothing is stored on ``Request``.

Preemption by recompute needs nothing here: the sampled tokens stay in the request and its
matcher has consumed exactly them, so when the recomputed prefill reaches the request's end
the next mask is the one it would have had.

With a reasoning parser, a request's grammar applies only once its reasoning has ended:
while thinking its row is unconstrained and the matcher untouched; the end marker switches
it on. Where the prompt leaves open whether the model thinks (no marker in the prompt), the
first token may be the start marker or anything the grammar allows. Speculative drafts are
free while the reasoning runs; the ones after a drafted end marker are checked by the
grammar (``drafts.row_plan``); the state advances only with the tokens the sampler took.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from atlas_vlm.reasoning import ENDED, MAYBE, REASONING
from atlas_vlm.structured_output.backend import (GuidanceBackend, StructuredOutputBackend, StructuredOutputGrammar,
                                                 allocate_token_bitmask)
from atlas_vlm.structured_output.drafts import draft_prefix_with_reasoning, fill_step_masks, row_plan


@dataclass
class StructuredOutputStats:
    """Time spent (seconds) and work done, for the benchmark."""

    compile_s: float = 0.0
    num_compiled: int = 0
    mask_s: float = 0.0  # filling masks (on the worker thread, beside the forward)
    mask_wait_s: float = 0.0  # the sampler waiting for them after the forward
    num_masks: int = 0  # bitmask rows filled
    drafts_checked: int = 0  # speculative draft tokens checked against a grammar
    drafts_cut: int = 0  # of those, cut (the grammar refused them or a token before them)
    reasoning_drafts: int = 0  # kept drafts the reasoning takes, free of the grammar (its end marker included)
    end_crossings: int = 0  # steps whose kept drafts end the reasoning (the grammar checks the ones after)


@dataclass
class GrammarBitmask:
    """One step's masks: ``bitmask[k]`` (int32 ``[words]``) is for ``request_ids[k]``; a
    request with ``d`` speculative drafts has ``d + 1`` consecutive entries (its verified rows,
    in order).

    The masks are filled on a worker thread while the forward runs (the grammar library
    works outside the GIL); reading ``bitmask`` waits for them."""

    request_ids: list[str]
    pending: Future  # resolves to the [len(request_ids), words] int32 tensor
    stats: StructuredOutputStats | None = None  # gets the time spent waiting for it

    @property
    def bitmask(self) -> torch.Tensor:
        t0 = time.perf_counter()
        result = self.pending.result()
        if self.stats is not None:
            self.stats.mask_wait_s += time.perf_counter() - t0
        return result


@dataclass
class _RequestGrammar:
    grammar: StructuredOutputGrammar
    reasoning: str = ENDED  # MAYBE | REASONING | ENDED


class StructuredOutputManager:
    """Grammar state of the engine's requests.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the logits width (bits per bitmask row at least; ids the tokenizer does
            not have are never allowed).
        eos_token_ids: ids that end a request; a constrained row allows them only where its
            grammar accepts.
        reasoning_parser: a ``ReasoningParser`` or None.
        backend_cls: the grammar library (``GuidanceBackend``), built on the first
            structured request (loading a 150k-token vocabulary takes about a second).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, reasoning_parser=None,
                 backend_cls: type[StructuredOutputBackend] = GuidanceBackend):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.reasoning_parser = reasoning_parser
        self.backend_cls = backend_cls
        self._backend: StructuredOutputBackend | None = None
        self._requests: dict[str, _RequestGrammar] = {}
        self._compiling: dict[str, Future] = {}  # request id -> its grammar, compiling
        self.stats = StructuredOutputStats()
        self._pool: ThreadPoolExecutor | None = None  # one worker: a step's masks beside its forward
        self._compile_pool: ThreadPoolExecutor | None = None  # one worker: grammars, off the engine thread
        self._backend_lock = threading.Lock()  # the backend is built on the compile thread or by a caller
        self._last_fill: Future | None = None  # the latest step's masks (drafts accepted there, then rolled back)

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self.backend_cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._backend

    def set_eos_token_ids(self, ids) -> None:
        """New EOS ids; grammars compiled from now on allow them where they accept."""
        if set(ids) != self.eos_token_ids:
            with self._backend_lock:
                self.eos_token_ids = set(ids)
                self._backend = None  # the library's tokenizer carries the EOS ids

    def _compile(self, params) -> StructuredOutputGrammar:
        """On the compile thread: the backend (built on first use, not counted) compiles ``params``."""
        backend = self.backend
        t0 = time.perf_counter()
        grammar = backend.compile_grammar(params)
        self.stats.compile_s += time.perf_counter() - t0
        self.stats.num_compiled += 1
        return grammar

    def add_request(self, req) -> bool:
        """Start compiling ``req``'s grammar on the compile thread (if its
        ``sampling_params.structured_outputs`` is set); ``poll_compiled`` collects it.

        Returns: True if a grammar is compiling (the request must wait for it).
        """
        params = req.sampling_params.structured_outputs
        if params is None:
            return False
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atlas-grammar-compile")
        self._compiling[req.request_id] = self._compile_pool.submit(self._compile, params)
        return True

    def poll_compiled(self, req) -> tuple[bool, str | None]:
        """Whether ``req``'s grammar is ready, without waiting; a finished compile is taken in.

        Returns:
            ``(ready, error)``: ready is False while it compiles; error says why the compile
            failed (the request must fail; nothing is kept), else None. A request without a
            grammar is ready.
        """
        future = self._compiling.get(req.request_id)
        if future is None:
            return True, None
        if not future.done():
            return False, None
        del self._compiling[req.request_id]
        try:
            grammar = future.result()
        except Exception as e:  # noqa: BLE001 - the library's refusal fails this request only
            return True, f"request {req.request_id!r}: {e}"
        state = ENDED
        if self.reasoning_parser is not None:
            state = self.reasoning_parser.initial_state(req.token_ids[:req.num_prompt_tokens])
        self._requests[req.request_id] = _RequestGrammar(grammar, state)
        return True, None

    def is_compiling(self, request_id: str) -> bool:
        """``request_id``'s grammar is still compiling or not yet collected by ``poll_compiled``."""
        return request_id in self._compiling

    def is_compiling_any(self) -> bool:
        """Some request's grammar is still compiling or not yet collected."""
        return bool(self._compiling)

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until one compiling grammar is done or ``timeout`` seconds have passed
        (returns at once if none is compiling)."""
        if self._compiling:
            wait(list(self._compiling.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request (idempotent); a compile not yet started is
        cancelled, one under way is dropped when it ends."""
        self._requests.pop(request_id, None)
        future = self._compiling.pop(request_id, None)
        if future is not None:
            future.cancel()

    def draft_prefix(self, req, drafts: list[int]) -> int:
        """How many of ``req``'s proposed speculative ``drafts`` to keep: those before the
        first one its grammar would refuse from its current state (nothing is consumed;
        vLLM cuts drafts the same way). All of them for a request without a grammar. While
        its reasoning runs the drafts are free up to the end marker; the ones after it are
        checked by the grammar from its start (``drafts.draft_prefix_with_reasoning``)."""
        state = self._requests.get(req.request_id)
        if state is None:
            return len(drafts)
        self._settle()
        start, end = self._markers()
        n = draft_prefix_with_reasoning(state.grammar, state.reasoning, drafts, start, end)
        self.stats.drafts_checked += len(drafts)
        self.stats.drafts_cut += len(drafts) - n
        if state.reasoning != ENDED:
            plan = row_plan(state.reasoning, drafts[:n], start, end)
            self.stats.reasoning_drafts += n - sum(len(d) for _, d in plan)
            self.stats.end_crossings += any(first > 0 for first, _ in plan)
        return n

    def _markers(self) -> tuple[int | None, int | None]:
        """The reasoning's start and end token ids (None, None without a parser)."""
        p = self.reasoning_parser
        return (p.start_token_id, p.end_token_id) if p is not None else (None, None)

    def _settle(self) -> None:
        """Wait for the latest step's masks (normally long done: the sampler read them), so
        no matcher is read or advanced here while the mask thread holds drafts in it (a
        forward that raised before its sampler waited)."""
        if self._last_fill is not None:
            wait([self._last_fill])
            self._last_fill = None

    def grammar_bitmask(self, chunks) -> GrammarBitmask | None:
        """Masks for the scheduled chunks that will sample a token (those reaching their
        request's end) and whose grammar applies now; None if there are none. A chunk with
        speculative drafts (``req.spec_token_ids``, cut by ``draft_prefix``) gets one row
        per verified row: row ``j`` is the mask after its first ``j`` drafts (``drafts``);
        with a reasoning parser the rows while the reasoning runs have all bits set and the
        ones after a drafted end marker the grammar's masks from its start (``row_plan``).

        Args:
            chunks: ``[(request, num_new_tokens)]`` as ``SchedulerOutput.chunks``, before the
                forward (``num_computed_tokens`` not yet advanced).
        """
        start, end = self._markers()
        request_ids, segments, maybe = [], [], []
        for req, n in chunks:
            state = self._requests.get(req.request_id)
            if state is None or req.num_computed_tokens + n != req.num_tokens:
                continue
            drafts = list(req.spec_token_ids or ())
            plan = row_plan(state.reasoning, drafts, start, end)
            if not plan:  # every row inside the reasoning: no mask, as without drafts
                continue
            if state.reasoning == MAYBE:  # its first row may open the reasoning instead
                maybe.append(len(request_ids))
            segments += [(state.grammar, len(request_ids) + first, d) for first, d in plan]
            request_ids += [req.request_id] * (len(drafts) + 1)
        if not request_ids:
            return None
        bitmask = allocate_token_bitmask(len(request_ids), self.backend.mask_vocab_size)

        def fill() -> torch.Tensor:
            t0 = time.perf_counter()
            fill_step_masks(self.backend, segments, bitmask)
            for k in maybe:  # the model may open its reasoning instead
                t = self.reasoning_parser.start_token_id
                bit = 1 << (t % 32)
                bitmask[k, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # as a signed int32
            self.stats.mask_s += time.perf_counter() - t0
            return bitmask

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atlas-grammar")
        self.stats.num_masks += len(request_ids)
        self._last_fill = self._pool.submit(fill)
        return GrammarBitmask(request_ids, self._last_fill, self.stats)

    def accept_token(self, req, token_id: int) -> tuple[bool, str | None]:
        """Advance ``req``'s matcher by its sampled token.

        Returns:
            ``(terminated, error)``: the grammar has ended (the request stops with "stop"),
            and why the token was refused (the request fails), if it was.
        """
        state = self._requests.get(req.request_id)
        if state is None:
            return False, None
        self._settle()
        if state.reasoning == REASONING:
            if token_id == self.reasoning_parser.end_token_id:
                state.reasoning = ENDED
            return False, None
        if state.reasoning == MAYBE:
            if token_id == self.reasoning_parser.start_token_id:
                state.reasoning = REASONING
                return False, None
            state.reasoning = ENDED
        if not state.grammar.accept_token(token_id):
            return False, (f"request {req.request_id!r}: token {token_id} is not allowed by its grammar "
                           f"({state.grammar.error() or 'rejected'})")
        return state.grammar.is_terminated(), None
