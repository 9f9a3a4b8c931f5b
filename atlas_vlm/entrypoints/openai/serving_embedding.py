"""``POST /v1/embeddings``: OpenAI embeddings request -> pooling requests on the engine (the
same prompt forms as completions and chat, batched with generation) -> OpenAI ``list`` of
``embedding`` objects. Wire format as OpenAI's API reference and vLLM's embedding route,
whose ``messages`` extension gives chat-style inputs with images.

Inputs (exactly one of):

- ``input``: a string, a list of strings, token ids, a list of token-id lists (OpenAI), or a
  list of ``{"messages": [...]}`` objects, each a conversation (OpenAI chat messages, images
  as ``image_url`` parts) embedded as one vector (this server's form for several image inputs
  in one call);
- ``messages``: one conversation, one vector (vLLM's ``EmbeddingChatRequest``).

Conversations go through the chat template with ``add_generation_prompt`` false unless
sent (vLLM's default for embeddings), ``mm_processor_kwargs`` as in chat.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from types import SimpleNamespace
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from atlas_vlm.entrypoints.openai.protocol import APIError, ChatMessage, MMProcessorKwargs, UnicodeBody, StrictModel
from atlas_vlm.entrypoints.openai.schema_rules import exactly_one, non_empty_prompt
from atlas_vlm.entrypoints.openai.serving_chat import chat_prompt
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, close_all, collect, new_id, start_choices
from atlas_vlm.entrypoints.openai.serving_completion import _validated, split_prompts
from atlas_vlm.pooling_params import PoolingParams


class MessagesInput(StrictModel):
    """One conversation to embed (an item of ``input``)."""

    messages: list[ChatMessage] = Field(min_length=1)


class EmbeddingRequest(UnicodeBody):
    """OpenAI's embeddings request plus vLLM's extras (``messages``, ``add_generation_prompt``,
    ``continue_final_message``, ``chat_template_kwargs``, ``mm_processor_kwargs``, ``normalize``)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | list[MessagesInput] | None = Field(
        default=None, json_schema_extra=non_empty_prompt)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    normalize: bool = True
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # exactly one of input and messages (``_one_input``), stated in the schema
    model_config = ConfigDict(json_schema_extra=exactly_one("input", "messages"))

    @model_validator(mode="after")
    def _one_input(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("send exactly one of input and messages")
        return self


async def _prompts(ctx: ServerContext, req: EmbeddingRequest) -> list:
    """The engine prompts of ``req`` (``split_prompts`` for text / ids; chat prompts, as the
    chat route builds them, for conversations).

    Raises:
        APIError(400): an empty ``input``, or bad media (from the chat route's helpers).
    """
    convs = [req.messages] if req.messages is not None else \
        [item.messages for item in req.input] if req.input and isinstance(req.input[0], MessagesInput) else None
    if convs is None:
        try:
            return split_prompts(req.input)
        except APIError as e:
            raise APIError(e.status, e.message.replace("prompt", "input"), "input", e.code) from e
    options = dict(mm_processor_kwargs=req.mm_processor_kwargs, add_generation_prompt=req.add_generation_prompt,
                   continue_final_message=req.continue_final_message,
                   chat_template_kwargs=req.chat_template_kwargs, tools=None)
    return [await chat_prompt(ctx, SimpleNamespace(messages=c, **options)) for c in convs]


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """``vector`` as OpenAI sends it: the floats, or (``"base64"``) the base64 text of their
    little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest) -> dict:
    """Returns the response dict ``{"object": "list", "data": [{"object": "embedding",
    "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`` (plus
    vLLM's ``id`` and ``created``).

    Raises:
        APIError: 400 bad input (naming the field: ``input``, ``messages``, ``dimensions``),
            404 unknown model, 500 engine step failed, 503 queue full.
    """
    model = ctx.check_model(req.model)
    prompts = await _prompts(ctx, req)
    if len(prompts) > ctx.max_prompts_per_request:
        raise APIError(400, f"{len(prompts)} inputs in one request; this server takes at most "
                       f"{ctx.max_prompts_per_request} (--max-prompts-per-request)", "input", "too_many_prompts")
    params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
    field = "messages" if req.messages is not None else "input"
    try:
        prompts = await _validated(ctx, prompts, params, field)  # one bad input: 400, none of them started
    except APIError as e:
        if e.param is None and e.status == 400:  # one input (or a request-wide limit): name the field
            e.param = field
        raise
    rid = new_id("embd")
    started = await asyncio.gather(*(start_choices(ctx, prompt, [params], f"{rid}-{i}")
                                     for i, prompt in enumerate(prompts)), return_exceptions=True)
    iters = [r[0][0] for r in started if not isinstance(r, BaseException)]
    failed = next((r for r in started if isinstance(r, BaseException)), None)
    if failed is not None:
        await close_all(iters)
        raise failed
    try:
        finals = await collect(iters)
    finally:
        await close_all(iters)
    bad = next((o for o in finals if o.embedding is None), None)
    if bad is not None:
        raise APIError(500, f"embedding failed: {bad.error or bad.finish_reason}", None, "engine_step_failed")
    num_tokens = sum(len(o.prompt_token_ids) for o in finals)
    data = [{"object": "embedding", "index": i, "embedding": encode(o.embedding, req.encoding_format)}
            for i, o in enumerate(finals)]
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
