"""``POST /v1/chat/completions``: OpenAI chat request -> engine requests -> OpenAI response
(one JSON object, or server-sent ``chat.completion.chunk`` events ending in ``[DONE]``).
Wire format as OpenAI's API reference and vLLM's ``serving_chat.py``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from atlas_vlm.entrypoints.openai.chat_output import ChatChoiceOutput
from atlas_vlm.entrypoints.openai.media import to_engine_messages
from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from atlas_vlm.entrypoints.openai.serving_common import (ServerContext, chat_logprobs, close_all, collect,
                                                         error_event, error_field, merge, new_id, sampling_params,
                                                         sse, start_choices, until_error, usage)
from atlas_vlm.entrypoints.openai.schema_check import check_tool_schemas
from atlas_vlm.entrypoints.openai.structured import structured_outputs_from_request
from atlas_vlm.tool_parsers import ToolParser, forced_tool_calls, resolve_tool_parser


async def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> dict:
    """The engine's chat prompt dict; vLLM's template switches only when the client sent them."""
    kwargs = req.mm_processor_kwargs.model_dump(exclude_none=True) if req.mm_processor_kwargs is not None else {}
    video = {{"num_frames": "nframes"}.get(k, k): kwargs.pop(k) for k in ("fps", "num_frames", "total_pixels")
             if k in kwargs}  # video sampling options go on each video item
    prompt = {"messages": await to_engine_messages(req.messages, ctx.media, ctx.is_vlm, video)}
    if kwargs:
        prompt["mm_options"] = kwargs
    for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
        if getattr(req, name) is not None:
            prompt[name] = getattr(req, name)
    if req.tools:
        prompt["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return prompt


def chat_constraint(ctx: ServerContext, req: ChatCompletionRequest):
    """The request's output constraint: a forced tool call (``tool_choice`` "required" or a
    named function) or ``response_format`` / vLLM's structured-output extras.

    Raises:
        APIError(400): an invalid tool ``parameters`` schema (any ``tool_choice``, named
            ``tools[i].function.parameters...``), ``tool_choice`` without ``tools``, a named function not in ``tools``,
            a refused schema, a forced tool call with a tool parser that cannot force calls
            (only ``hermes`` can), or a forced tool call together with another constraint.
    """
    check_tool_schemas(req.tools)  # under every tool_choice, before any grammar is built
    constraint = structured_outputs_from_request(req)
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
    if not req.tools:
        return constraint
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    named = choice.model_dump() if hasattr(choice, "model_dump") else choice
    try:
        forced = forced_tool_calls(_parser_cls(ctx), tools, named, req.parallel_tool_calls, ctx.engine.tokenizer)
    except ValueError as e:
        param = "tools" if str(e).startswith("tools:") and not isinstance(named, dict) else "tool_choice"
        raise APIError(400, str(e), param, "invalid_value") from e
    if forced is not None and constraint is not None:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'function'!r} cannot be combined "
                       "with response_format or structured outputs", "tool_choice", "invalid_value")
    return forced or constraint


def _parser_cls(ctx: ServerContext) -> type[ToolParser]:
    """The server's tool parser class: ``--tool-call-parser``'s, else the one the tokenizer's
    chat template points to (``atlas_vlm.tool_parsers.detect_tool_parser``)."""
    return ctx.tool_parser or resolve_tool_parser(None, getattr(ctx.engine.tokenizer, "chat_template", None))


def chat_tool_parser(ctx: ServerContext, req: ChatCompletionRequest) -> ToolParser | None:
    """The request's tool parser instance (it may read the tools' schemas), or None when
    tool calls are not parsed (no ``tools``, or ``tool_choice`` "none")."""
    if not req.tools or req.tool_choice == "none":
        return None
    return _parser_cls(ctx)([t.model_dump(exclude_none=True) for t in req.tools])


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest):
    """Returns a response dict, or (``stream=True``) an async iterator of SSE strings (a
    failure midway ends it with an error event, then ``[DONE]``).

    Raises:
        APIError: 400 bad input, 404 unknown model, 500 engine step failed, 503 queue full.
    """
    model = ctx.check_model(req.model)
    if req.top_logprobs and not req.logprobs:  # 0 asks for no alternatives: fine without logprobs
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream=true", "stream_options", "invalid_value")
    params, prompt, views = await prepare_chat(ctx, req)
    rid = new_id("chatcmpl")
    iters, first = await start_choices(ctx, prompt, params, rid)
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        return _stream(ctx, iters, first, rid, model, created, include_usage, views, continuous)
    return await _full(ctx, iters, first, rid, model, created, views)


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest) -> tuple[list, dict, list[ChatChoiceOutput]]:
    """What a chat request becomes for the engine (shared with ``/v1/responses``, which
    translates its requests to chat requests): one ``SamplingParams`` per choice, the chat
    prompt dict, and one output view (``ChatChoiceOutput``) per choice.

    Raises:
        APIError(400): bad tools / tool_choice / structured output / sampling values, a bad image.
    """
    k = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    constraint = chat_constraint(ctx, req)
    params = [sampling_params(req, max_tokens, k, i, constraint) for i in range(req.n)]
    prompt = await chat_prompt(ctx, req)
    views = [ChatChoiceOutput(ctx.reasoning_parser, parser is not None, parser)
             for parser in (chat_tool_parser(ctx, req) for _ in range(req.n))]
    return params, prompt, views


async def _full(ctx, iters, first, rid, model, created, views) -> dict:
    try:
        finals = await collect(iters)
    finally:
        await close_all(iters + [first])
    choices = []
    for i, out in enumerate(finals):
        lp = None
        if out.logprobs is not None:
            lp = chat_logprobs(ctx.engine.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
        message, finish_reason = views[i].message(out)
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish_reason,
                        **error_field(out)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(finals[0].prompt_token_ids), sum(len(o.token_ids) for o in finals),
                           first.num_cached_tokens)}


async def _stream(ctx, iters, first, rid, model, created, include_usage, views, continuous=False) -> AsyncIterator[str]:
    """SSE chunks from each choice's DELTA outputs: the view (``ChatChoiceOutput``) turns the
    new text into reasoning / content / tool-call deltas; logprobs are the step's new entries.
    ``continuous``: each chunk's ``usage`` is the counts so far (vLLM's continuous_usage_stats)."""
    n = len(iters)
    sent_chunks = [0] * n
    prompt_tokens, completion = 0, [0] * n
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    try:
        async for i, out in until_error(merge(iters)):
            if isinstance(out, BaseException):  # the engine failed midway: say so, then end the stream
                yield error_event(out)
                yield sse("[DONE]")
                return
            new_ids = out.token_ids
            if i == 0:  # the n choices share one prompt; only a request's first DELTA carries its ids
                prompt_tokens += len(out.prompt_token_ids)
            completion[i] += len(new_ids)
            delta, finish_reason = views[i].feed_delta(out)
            if not delta and not out.finished and not (new_ids and out.logprobs is not None):
                continue
            if "content" not in delta and "tool_calls" not in delta and "reasoning_content" not in delta:
                delta["content"] = ""
            if sent_chunks[i] == 0:
                delta = {"role": "assistant", **delta}
            lp = None
            if out.logprobs is not None and new_ids:
                lp = chat_logprobs(ctx.engine.tokenizer, new_ids, out.logprobs, out.top_logprobs)
            sent_chunks[i] += 1
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                      **error_field(out)}
            so_far = usage(prompt_tokens, sum(completion), first.num_cached_tokens) if continuous else None
            yield sse({**base, "choices": [choice], **({"usage": so_far} if include_usage else {})})
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, sum(completion), first.num_cached_tokens)})
        yield sse("[DONE]")
    finally:
        await close_all(iters + [first])
