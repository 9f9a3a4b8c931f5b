"""``POST /v1/completions``: raw prompts (a string, token ids, or a list of either) -> engine
requests -> OpenAI ``text_completion`` (one object, or SSE chunks ending in ``[DONE]``).
Choice ``index`` is ``prompt_index * n + j``, as OpenAI and vLLM number them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from atlas_vlm.entrypoints.openai.protocol import APIError, CompletionRequest
from atlas_vlm.entrypoints.openai.serving_common import (ServerContext, close_all, collect, completion_logprobs,
                                                         engine_error, error_event, error_field, merge, new_id,
                                                         sampling_params, sse, start_choices, until_error, usage)
from atlas_vlm.entrypoints.openai.structured import structured_outputs_from_request


def split_prompts(prompt) -> list:
    """The request's ``prompt`` field -> engine prompts (str, or ``{"prompt_token_ids": ids}``).

    Raises:
        APIError(400): an empty prompt list.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


async def _validated(ctx: ServerContext, prompts: list, params, field: str = "prompt") -> list:
    """Every prompt checked (``AsyncLLM.validate_prompts``) before any is admitted; the
    returned ``ProcessedPrompt``s are not tokenized again.

    Raises:
        APIError: the first bad prompt's error (``engine_error``), naming its index (as
            ``field.index``) when the request has several prompts.
    """
    validate = getattr(ctx.engine, "validate_prompts", None)
    if validate is None:  # RemoteEngine (--replicas): each replica checks its own; a failure closes the others
        return prompts
    try:
        return await validate(prompts, params)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        err = engine_error(e)
        if len(prompts) > 1 and getattr(e, "prompt_index", None) is not None:
            err = APIError(err.status, f"{field} {e.prompt_index}: {err.message}", f"{field}.{e.prompt_index}",
                           err.code)
        raise err from e


async def create_completion(ctx: ServerContext, req: CompletionRequest):
    """Returns a response dict, or (``stream=True``) an async iterator of SSE strings (a
    failure midway ends it with an error event, then ``[DONE]``).

    Raises:
        APIError: 400 bad input, 404 unknown model, 500 engine step failed, 503 queue full.
    """
    model = ctx.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream=true", "stream_options", "invalid_value")
    prompts = split_prompts(req.prompt)
    if len(prompts) > ctx.max_prompts_per_request:
        raise APIError(400, f"{len(prompts)} prompts in one request; this server takes at most "
                       f"{ctx.max_prompts_per_request} (--max-prompts-per-request)", "prompt", "too_many_prompts")
    constraint = structured_outputs_from_request(req)
    params = [sampling_params(req, req.max_tokens, req.logprobs, j, constraint) for j in range(req.n)]
    rid = new_id("cmpl")
    prompts = await _validated(ctx, prompts, params[0])  # one bad prompt: 400, and none of them is started
    # every prompt is queued at once (they batch together), not one after another
    started = await asyncio.gather(*(start_choices(ctx, prompt, params, f"{rid}-{p_idx}")
                                     for p_idx, prompt in enumerate(prompts)), return_exceptions=True)
    iters = [it for r in started if not isinstance(r, BaseException) for it in r[0]]
    firsts = [r[1] for r in started if not isinstance(r, BaseException)]
    failed = next((r for r in started if isinstance(r, BaseException)), None)
    if failed is not None:
        await close_all(iters + firsts)
        raise failed
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    cached = lambda: sum(f.num_cached_tokens for f in firsts)  # noqa: E731
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        return _stream(ctx, iters, firsts, req.n, base, cached, include_usage, continuous)
    return await _full(ctx, iters, firsts, req.n, base, cached)


def _usage(prompt_tokens: list[int], completion_tokens: list[int], n: int, cached) -> dict:
    """Usage over every choice; each prompt's tokens counted once (``n`` choices per prompt)."""
    return usage(sum(prompt_tokens[i] for i in range(0, len(prompt_tokens), n)), sum(completion_tokens), cached)


async def _full(ctx, iters, firsts, n, base, cached) -> dict:
    try:
        finals = await collect(iters)
    finally:
        await close_all(iters + firsts)
    choices = []
    for i, out in enumerate(finals):
        lp = None
        if out.logprobs is not None:
            lp = completion_logprobs(ctx.engine.tokenizer, out.token_ids, out.logprobs, out.top_logprobs, 0)
        choices.append({"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason,
                        **error_field(out)})
    return {**base, "choices": choices, "usage": _usage([len(o.prompt_token_ids) for o in finals],
                                                        [len(o.token_ids) for o in finals], n, cached())}


async def _stream(ctx, iters, firsts, n, base, cached, include_usage, continuous=False) -> AsyncIterator[str]:
    """SSE chunks from each choice's DELTA outputs (new text, ids and logprobs per step);
    a step that shows nothing new (text held back for a stop string) sends no chunk.
    ``continuous``: each chunk's ``usage`` is the counts so far (vLLM's continuous_usage_stats)."""
    offsets = [0] * len(iters)  # text_offset of each choice's next token (as the whole answer counts them)
    prompt_tokens, completion_tokens = [0] * len(iters), [0] * len(iters)
    try:
        async for i, out in until_error(merge(iters)):
            if isinstance(out, BaseException):  # the engine failed midway: say so, then end the stream
                yield error_event(out)
                yield sse("[DONE]")
                return
            prompt_tokens[i] += len(out.prompt_token_ids)  # only a request's first DELTA carries them
            completion_tokens[i] += len(out.token_ids)
            text, new_ids = out.text, out.token_ids
            if not text and not out.finished and not (new_ids and out.logprobs is not None):
                continue
            lp = None
            if out.logprobs is not None and new_ids:
                lp = completion_logprobs(ctx.engine.tokenizer, new_ids, out.logprobs, out.top_logprobs, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                      **error_field(out)}
            so_far = _usage(prompt_tokens, completion_tokens, n, cached()) if continuous else None
            yield sse({**base, "choices": [choice], **({"usage": so_far} if include_usage else {})})
        if include_usage:
            yield sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens, n, cached())})
        yield sse("[DONE]")
    finally:
        await close_all(iters + firsts)
