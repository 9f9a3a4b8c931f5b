"""The scheduler's side of speculative decoding (``engine.scheduler.Scheduler`` calls these).

Before a step (``add_drafts``): a decoding request whose newest token's slot is reserved gets
up to ``k`` draft tokens from the proposer, appended to its ``token_ids`` (so the step's chunk
is its last sampled token + the drafts, computed causally over the paged cache like a
prefill chunk) with their slots reserved. Drafts never cause a preemption: if their slots do
not fit, the request decodes without drafts this step.

After the forward (``take_verified``): the drafts leave ``token_ids`` again and the rows to
take are chosen (Leviathan et al. 2023): row ``j`` holds the target's choice after draft
``j`` (greedy: its argmax; sampled: the draft if ``spec_decode.rejection`` accepted it, else
the replacement it drew); rows are taken while the previous draft equals the row's token,
plus the target's own next token. For greedy requests, taking those rows one by one
reproduces, token for token, what decoding without drafts would have done. The scheduler then commits only the K/V of the
accepted tokens and gives back the rejected drafts' slots (``free_uncomputed_tail``); a
hybrid model's recurrent state is rolled back to the same point (``accept_state_rows``).

No request drafts while more than ``speculative_disable_by_batch_size`` requests run (a
batched step is bound by compute, not by reading the weights: measured, drafts lost there).
Which requests get drafts: every decoding request but pooling ones (those decode one token
per step as without speculation). A request with structured output keeps only the drafts
before the first one its grammar refuses (``StructuredOutputManager.draft_prefix``; free
while its reasoning runs, the grammar checks those after a drafted end marker), and its
verified rows get one mask each, row ``j`` the mask after ``j`` drafts (no constraint on
rows inside the reasoning); the matcher is then fed the taken tokens only, as vLLM does.
How many: ``k``, unless the request's recent acceptance (a moving average over its verified steps,
``Request.spec_acceptance``) fell below ``ACCEPTANCE_FLOOR``: drafts then cost a verification
row each and rarely pay (free writing: ~2% accepted, measured), so the request decodes
without them and probes with one draft every ``PROBE_EVERY`` tokens, which lifts the average
again when its text turns to copying. Measured in ``scripts/bench.py --spec``.
"""

from __future__ import annotations

from mm_kv_cache_management import NoFreeBlocksError

ACCEPTANCE_FLOOR = 0.25  # below this recent acceptance rate a request drafts only to probe
ACCEPTANCE_DECAY = 0.7  # moving average: new = DECAY * old + (1 - DECAY) * this step's rate
PROBE_EVERY = 8  # output tokens between probes (one draft) of a request below the floor


def can_draft(req) -> bool:
    """Whether ``req`` decodes with drafts: speculation on for it (``spec_decode`` set), not
    a pooling request. Greedy and sampled requests both do (sampled ones are verified by
    ``spec_decode.rejection``), with or without structured output (its drafts are cut to
    what the request's grammar allows in ``add_drafts``)."""
    return req.spec_decode is not None and req.pooling_params is None


def draft_limit(req, k: int, budget: int, max_model_len: int | None) -> int:
    """Drafts ``req`` may carry this step: at most ``k``, ``budget - 1`` (tokens left in the
    step besides the sampled one), and no more than could be accepted before ``max_tokens``
    or ``max_model_len`` ends the request (all drafts + the target's token must fit); a
    request whose recent acceptance is below ``ACCEPTANCE_FLOOR`` gets one draft every
    ``PROBE_EVERY`` output tokens and none between."""
    if req.spec_acceptance < ACCEPTANCE_FLOOR:
        k = min(k, 1) if req.num_output_tokens % PROBE_EVERY == 0 else 0
    limit = min(k, budget - 1, req.max_tokens - req.num_output_tokens - 1)
    if max_model_len is not None:
        limit = min(limit, max_model_len - req.num_tokens - 1)
    return max(0, limit)


def add_drafts(scheduler, req, budget: int) -> int:
    """Propose and append ``req``'s drafts and reserve their slots (call after its decode
    slot is reserved). Returns how many were added (0: none proposed, or no free block for
    them, or its grammar refused the first; nothing changed then)."""
    limit = scheduler.speculative_disable_by_batch_size
    if not can_draft(req) or (limit is not None and len(scheduler.running) > limit):
        return 0
    k = draft_limit(req, scheduler.num_speculative_tokens, budget, scheduler.max_model_len)
    drafts = scheduler.proposer.propose(req.token_ids, k, req.mm_positions, request_id=req.request_id) if k else []
    manager = scheduler.structured_output_manager
    if drafts and manager is not None:
        drafts = drafts[:manager.draft_prefix(req, drafts)]
    if not drafts:
        return 0
    req.token_ids.extend(drafts)
    try:
        scheduler.block_manager.decode_append(req)  # reserves every slot up to the last draft
    except NoFreeBlocksError:
        del req.token_ids[-len(drafts):]
        return 0
    req.spec_token_ids = list(drafts)
    return len(drafts)


def take_verified(scheduler, req, sampled, first_row: int) -> list[int]:
    """The sampler rows ``first_row .. first_row + k`` of ``req``'s verified step: remove
    its ``k`` drafts from ``token_ids``, count them, and return the rows to take in order
    (each one's token is then handled as a plain decode's). A row's token is only taken if
    every draft before it was accepted; a failed row is taken (it fails the request) and
    ends the run."""
    drafts, req.spec_token_ids = req.spec_token_ids, []
    del req.token_ids[-len(drafts):]
    rows = []
    for j in range(len(drafts) + 1):
        row = first_row + j
        rows.append(row)
        if j == len(drafts) or sampled.errors[row] is not None or sampled.token_ids[row] != drafts[j]:
            break
    accepted = len(rows) - 1
    req.spec_acceptance = ACCEPTANCE_DECAY * req.spec_acceptance + (1 - ACCEPTANCE_DECAY) * accepted / len(drafts)
    for stats in (req.spec_decode, scheduler.spec_decode_stats):
        stats["drafts"] += 1
        stats["proposed"] += len(drafts)
        stats["accepted"] += accepted
    return rows


def commit_verified(scheduler, req, num_rows: int) -> None:
    """Commit the K/V of ``req``'s last sampled token and its accepted drafts (``num_rows``
    taken rows: ``num_rows - 1`` drafts accepted), capped at the tokens ``req`` kept (a stop
    inside the run), then give back the slots past them; a hybrid model's recurrent state
    goes back to the state after the same rows (``BlockManager.accept_state_rows``)."""
    num_rows = min(num_rows, req.num_tokens - req.num_computed_tokens)
    scheduler.block_manager.commit_computed(req, num_rows)
    scheduler.block_manager.free_uncomputed_tail(req)
    scheduler.block_manager.accept_state_rows(req, num_rows)
