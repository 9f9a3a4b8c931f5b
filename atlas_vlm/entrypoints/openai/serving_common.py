"""What chat and completions share: sampling params from a request, starting ``n`` engine
requests per prompt, merging their output streams, engine errors as HTTP errors, and the
usage / logprobs / SSE wire formats (OpenAI's, as vLLM writes them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from atlas_vlm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError, QueueFullError, RequestStream
from atlas_vlm.entrypoints.openai.access_log import record_streams
from atlas_vlm.entrypoints.openai.protocol import APIError, printable
from atlas_vlm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ServerContext:
    """What a route needs: the engine front and the server's settings."""

    engine: AsyncLLM
    model_names: list[str]  # served names; the first is reported in responses
    is_vlm: bool
    media: object  # media.MediaPolicy
    max_model_len: int
    max_prompts_per_request: int = 64  # completions: prompts in one call at most (--max-prompts-per-request)
    model_root: str | None = None  # the model path or id behind the served names (model card ``root``)
    reasoning_parser: object = None  # atlas_vlm.reasoning.ReasoningParser: split thinking from content
    tool_parser: type | None = None  # an atlas_vlm.tool_parsers.ToolParser class; None: from the chat template
    model_info: object = None  # model_card.ModelInfo of the /v1/models cards; None: from is_vlm alone

    def check_model(self, name: str | None) -> str:
        """The served name responses carry (the first one) for a request's ``model``: a
        served name, the model path the server was started with (lenient:
        ``served_name.same_model_path``), or None.

        Raises:
            APIError(404): a model name we do not serve.
        """
        from atlas_vlm.entrypoints.openai.served_name import same_model_path

        if name is not None and name not in self.model_names and not same_model_path(name, self.model_root):
            raise APIError(404, f"The model `{name}` does not exist; this server serves {self.model_names}",
                           "model", "model_not_found")
        return self.model_names[0]

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None):
        """``async with ctx.lease(model) as c``: this context (``model`` checked by the
        serving function); a several-model server's ``RoutedContext.lease`` loads and holds the named model."""
        yield self


def output_kind(stream: bool, n: int, index: int) -> RequestOutputKind:
    """What choice ``index`` of ``n`` needs from the engine: a stream formats each step's
    DELTA; a whole answer needs the FINAL_ONLY output, except choice 0 of ``n > 1``, whose
    first output (after its prefill) ``start_choices`` waits for, so DELTAs folded by ``collect``."""
    if stream or (n > 1 and index == 0):
        return RequestOutputKind.DELTA
    return RequestOutputKind.FINAL_ONLY


async def collect(iters: list[AsyncIterator]) -> list:
    """The final ``RequestOutput`` of every stream (``merge``d), DELTA outputs folded together
    (``RequestOutput.add``), so each holds the whole text, ids, logprobs and prompt ids."""
    finals = [None] * len(iters)
    async for i, out in merge(iters):
        finals[i] = out if finals[i] is None else finals[i].add(out)
    return finals


def penalty_kwargs(req) -> dict:
    """``SamplingParams`` keywords of ``req``'s ``min_p``, penalties and ``logit_bias`` (those
    set; its string keys as token ids: the schema's ``LogitBias`` admits only digit keys)."""
    kw = {k: getattr(req, k, None) for k in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
    kw = {k: v for k, v in kw.items() if v is not None}
    bias = getattr(req, "logit_bias", None)
    if bias:
        kw["logit_bias"] = {int(t): b for t, b in bias.items()}
    return kw


def sampling_params(req, max_tokens: int | None, logprobs: int | None, index: int = 0,
                    structured_outputs=None) -> SamplingParams:
    """SamplingParams of choice ``index`` of ``req``; choice ``i > 0`` of a seeded request uses
    ``seed + i`` so the ``n`` choices differ when sampling (vLLM draws them from one generator).
    ``structured_outputs``: the request's ``StructuredOutputsParams`` (or None). The output
    kind follows ``req.stream`` and ``req.n`` (``output_kind``).

    Raises:
        APIError(400): a value out of range (the message names it).
    """
    try:
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=None if req.seed is None else req.seed + index, max_tokens=max_tokens,
            stop=req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else [],
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs,
            structured_outputs=structured_outputs,
            output_kind=output_kind(bool(req.stream), req.n, index), **penalty_kwargs(req),
        )
    except (ValueError, TypeError) as e:  # a SamplingParamsError names its field
        raise APIError(400, f"invalid sampling parameters: {e}", getattr(e, "param", None), "invalid_value") from e


def engine_error(e: Exception) -> APIError:
    """Map ``AsyncLLM.add_request`` errors to HTTP: queue full or shutting down 503, bad input 400."""
    from atlas_vlm.engine.engine import RequestTooLongError
    from mm_token_pipeline import ImageInputError, VideoInputError

    if isinstance(e, QueueFullError):
        return APIError(503, str(e), None, "queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), None, "engine_unavailable")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), None, "engine_step_failed")
    if isinstance(e, RequestTooLongError):
        return APIError(400, str(e), None, "context_length_exceeded")
    if isinstance(e, ImageInputError):
        return APIError(400, str(e), "messages", "invalid_image")
    if isinstance(e, VideoInputError):
        return APIError(400, str(e), "messages", "invalid_video")
    return APIError(400, str(e), getattr(e, "param", None), "invalid_value")  # param: e.g. PoolingParamsError


async def start_choices(ctx: ServerContext, prompt, params: list[SamplingParams],
                        base_id: str) -> tuple[list[AsyncIterator], RequestStream]:
    """Add ``len(params)`` requests for one prompt. With ``n > 1`` the later choices are added
    after the first one's prefill, so the prefix cache gives them the prompt's full blocks.

    Returns:
        (one output iterator per choice, the first choice's ``RequestStream`` for its
        prefix-cache hits).

    Raises:
        APIError: from ``engine_error`` (nothing is left running).
    """
    started: list[RequestStream] = []
    arrival = time.monotonic()
    try:
        first = await ctx.engine.add_request(prompt, params[0], f"{base_id}-0", arrival)
        started.append(first)
        record_streams(base_id, started)
        if len(params) == 1:
            return [first], first
        it = aiter(first)
        head = await anext(it)
        for i, p in enumerate(params[1:], 1):
            started.append(await ctx.engine.add_request(prompt, p, f"{base_id}-{i}", arrival))
            record_streams(base_id, started[-1:], counts_prompt=False)
        return [_prepend(head, first), *started[1:]], first
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        for s in started:
            await s.aclose()
        raise engine_error(e) from e
    except BaseException:
        for s in started:
            await s.aclose()
        raise


async def _prepend(head, stream: RequestStream) -> AsyncIterator:
    """``head`` (already read from ``stream``), then the rest of ``stream``; closing this
    closes (and so aborts) ``stream``."""
    try:
        yield head
        if not head.finished:
            async for out in stream:
                yield out
    finally:
        await stream.aclose()


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave ``(choice_index, RequestOutput)`` from several streams as outputs arrive;
    leaving early closes (and so aborts) every unfinished stream."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await q.put((i, e))
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            if hasattr(s, "aclose"):
                await s.aclose()


async def until_disconnected(coro, receive):
    """Await ``coro`` (a route's work: preparing, queueing and, for a non-streamed answer,
    running its requests); if the client goes away first (ASGI ``receive`` yields
    ``http.disconnect``, noticed at once), cancel it, so that its requests are aborted
    wherever they are (being prepared, queued before prefill, running) and their blocks freed.

    Raises:
        APIError(400, code ``client_disconnected``): the client left (nobody reads it).
    """
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(400, "client disconnected; request aborted", None, "client_disconnected")
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def until_error(items: AsyncIterator) -> AsyncIterator:
    """``items``, then, if it raised an ``Exception``, ``(None, exception)`` as its last item
    (a stream turns it into an error event; cancellation still propagates)."""
    try:
        async for item in items:
            yield item
    except Exception as e:  # noqa: BLE001 - handed to the stream, which reports it to the client
        yield None, e


def error_field(out) -> dict:
    """``{"error": message}`` for a choice whose request failed alone (``finish_reason ==
    "error"``: its message names the request's parameter at fault), else ``{}``."""
    return {"error": printable(out.error or "the request failed")} if out.finish_reason == "error" else {}


def error_event(e: BaseException) -> str:
    """The SSE event that ends a stream whose requests failed midway (OpenAI JSON error, as
    vLLM streams it), to be followed by ``data: [DONE]``."""
    err = e if isinstance(e, APIError) else engine_error(e) if isinstance(
        e, (QueueFullError, EngineDeadError, EngineStepError)) else APIError(
        500, f"internal error while streaming: {type(e).__name__}: {printable(str(e))}", None, "internal_error")
    return sse(err.body())


async def close_all(streams: list) -> None:
    """Close every stream (idempotent); an unfinished request among them is aborted."""
    for s in streams:
        if hasattr(s, "aclose"):
            await s.aclose()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI ``usage`` (token counts; ``cached_tokens``: prompt tokens from the prefix cache)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_str(tokenizer, token_id: int) -> str:
    """The text of one token (as ``tokenizer.decode([id])``; a partial UTF-8 byte shows as U+FFFD)."""
    return tokenizer.decode([token_id])


def _finite(lp: float) -> float:
    """A logprob JSON can carry: ``-inf`` (a token a grammar forbids) as vLLM's -9999.0."""
    return max(lp, -9999.0)


def chat_logprobs(tokenizer, ids: list[int], lps: list[float], tops: list[dict]) -> dict:
    """OpenAI chat ``logprobs.content``: per token its string, logprob, UTF-8 bytes and top list."""
    def entry(t, lp):
        s = token_str(tokenizer, t)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    content = []
    for t, lp, top in zip(ids, lps, tops):
        e = entry(t, lp)
        e["top_logprobs"] = [entry(k, v) for k, v in sorted(top.items(), key=lambda kv: -kv[1])]
        content.append(e)
    return {"content": content}


def completion_logprobs(tokenizer, ids: list[int], lps: list[float], tops: list[dict], offset: int) -> dict:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_str(tokenizer, t) for t in ids]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in lps],
            "top_logprobs": [{token_str(tokenizer, k): _finite(v) for k, v in top.items()} for top in tops],
            "text_offset": offsets}


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: {...}\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
