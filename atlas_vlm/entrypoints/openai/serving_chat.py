"""``POST /v1/chat/completions``: OpenAI chat request -> engine requests -> OpenAI response
(one JSON object, or server-sent ``chat.completion.chunk`` events ending in ``[DONE]``).
Wire format as OpenAI's API reference and vLLM's ``serving_chat.py``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from atlas_vlm.entrypoints.openai.media import to_engine_messages
from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from atlas_vlm.entrypoints.openai.serving_common import (ServerContext, chat_logprobs, close_all, error_event,
                                                         error_field, merge, new_id, sampling_params, sse,
                                                         start_choices, until_error, usage)


async def _prompt(ctx: ServerContext, req: ChatCompletionRequest) -> dict:
    """The engine's chat prompt dict; vLLM's template switches only when the client sent them."""
    prompt = {"messages": await to_engine_messages(req.messages, ctx.media, ctx.is_vlm)}
    if req.mm_processor_kwargs is not None:
        opts = req.mm_processor_kwargs.model_dump(exclude_none=True)
        if opts:
            prompt["mm_options"] = opts
    for name in ("add_generation_prompt", "continue_final_message"):
        if getattr(req, name) is not None:
            prompt[name] = getattr(req, name)
    return prompt


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest):
    """Returns a response dict, or (``stream=True``) an async iterator of SSE strings (a
    failure midway ends it with an error event, then ``[DONE]``).

    Raises:
        APIError: 400 bad input, 404 unknown model, 500 engine step failed, 503 queue full.
    """
    model = ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream=true", "stream_options", "invalid_value")
    k = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = [sampling_params(req, max_tokens, k, i) for i in range(req.n)]
    prompt = await _prompt(ctx, req)
    rid = new_id("chatcmpl")
    iters, first = await start_choices(ctx, prompt, params, rid)
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(ctx, iters, first, rid, model, created, include_usage)
    return await _full(ctx, iters, first, rid, model, created)


async def _full(ctx, iters, first, rid, model, created) -> dict:
    finals = [None] * len(iters)
    try:
        async for i, out in merge(iters):
            if out.finished:
                finals[i] = out
    finally:
        await close_all(iters + [first])
    choices = []
    for i, out in enumerate(finals):
        lp = None
        if out.logprobs is not None:
            lp = chat_logprobs(ctx.engine.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
        choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                        "finish_reason": out.finish_reason, **error_field(out)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(finals[0].prompt_token_ids), sum(len(o.token_ids) for o in finals),
                           first.num_cached_tokens)}


async def _stream(ctx, iters, first, rid, model, created, include_usage) -> AsyncIterator[str]:
    n = len(iters)
    sent_chars, sent_tokens = [0] * n, [0] * n
    prompt_tokens, completion = 0, [0] * n
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    try:
        async for i, out in until_error(merge(iters)):
            if isinstance(out, BaseException):  # the engine failed midway: say so, then end the stream
                yield error_event(out)
                yield sse("[DONE]")
                return
            text = out.text[sent_chars[i]:] if len(out.text) > sent_chars[i] else ""
            new_ids = out.token_ids[sent_tokens[i]:]
            prompt_tokens, completion[i] = len(out.prompt_token_ids), len(out.token_ids)
            if not text and not out.finished and not (new_ids and out.logprobs is not None):
                continue
            delta = {"content": text}
            if sent_tokens[i] == 0 and sent_chars[i] == 0:
                delta = {"role": "assistant", "content": text}
            lp = None
            if out.logprobs is not None and new_ids:
                s = sent_tokens[i]
                lp = chat_logprobs(ctx.engine.tokenizer, new_ids, out.logprobs[s:], out.top_logprobs[s:])
            sent_chars[i] += len(text)
            sent_tokens[i] = len(out.token_ids)
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason,
                      **error_field(out)}
            yield sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, sum(completion), first.num_cached_tokens)})
        yield sse("[DONE]")
    finally:
        await close_all(iters + [first])
