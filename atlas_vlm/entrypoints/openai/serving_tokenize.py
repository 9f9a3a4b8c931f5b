"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes
(``vllm/entrypoints/openai/protocol.py``: ``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``TokenizeResponse``, ``DetokenizeRequest``, ``DetokenizeResponse``).

- ``/tokenize`` with ``{"model", "prompt", "add_special_tokens": true}``: the prompt's ids as
  the engine would tokenize it; with ``{"model", "messages", "add_generation_prompt": true,
  "continue_final_message": false, "add_special_tokens": false, "chat_template_kwargs",
  "tools"}``: the chat prompt's ids as ``/v1/chat/completions`` builds them (each image or
  video's placeholder tokens expanded). ``"return_token_strs": true`` adds each token's
  string (``tokenizer.convert_ids_to_tokens``). Answer: ``{"count", "max_model_len",
  "tokens", "token_strs"}`` (``token_strs`` null unless asked).
- ``/detokenize`` with ``{"model", "tokens"}``: ``{"prompt": text}``; a token id outside the
  tokenizer's vocabulary is a 400 naming it.

Errors are OpenAI's error JSON. The routes exist where the server holds the tokenizer (not
behind the Ray ingress, which holds none).
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from pydantic import BaseModel, Discriminator, Field, Tag

from atlas_vlm.entrypoints.openai.media import to_engine_messages
from atlas_vlm.entrypoints.openai.protocol import APIError, ChatMessage, Tool, UnicodeBody
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, engine_error


class TokenizeCompletionRequest(UnicodeBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(UnicodeBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict | None = None
    tools: list[Tool] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


def _form(body) -> str:
    """Which request a body is: chat when it has ``messages``, else a prompt (so that a bad
    body's errors name its own fields)."""
    return "chat" if isinstance(body, dict) and "messages" in body else "prompt"


TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("prompt")] |
                            Annotated[TokenizeChatRequest, Tag("chat")], Discriminator(_form)]


class DetokenizeRequest(UnicodeBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]  # ids in the vocabulary (its size: unstatable here)


class DetokenizeResponse(BaseModel):
    prompt: str


def _with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` with the tokenizer's special tokens around them (a BOS for Llama; nothing for
    Qwen or SmolLM2), as ``tokenizer(text, add_special_tokens=True)`` adds them."""
    build = getattr(tokenizer, "build_inputs_with_special_tokens", None)
    return list(build(list(ids))) if build is not None else list(ids)


async def tokenize(ctx: ServerContext, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    """The ``TokenizeResponse`` of ``req`` as a dict.

    Raises:
        APIError: 404 unknown model; 400 a bad chat prompt or image (as chat completions).
    """
    ctx.check_model(req.model)
    front = ctx.engine
    tokenizer = front.engine.input_processor.tokenizer  # serialized: one call at a time across input workers
    try:
        if isinstance(req, TokenizeChatRequest):
            prompt = {"messages": await to_engine_messages(req.messages, ctx.media, ctx.is_vlm, {}),
                      "add_generation_prompt": req.add_generation_prompt,
                      "continue_final_message": req.continue_final_message}
            if req.chat_template_kwargs is not None:
                prompt["chat_template_kwargs"] = req.chat_template_kwargs
            if req.tools:
                prompt["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
            processed = await asyncio.to_thread(front.engine.process_prompt, prompt)
            ids = list(processed.prompt_token_ids)
            if req.add_special_tokens:
                ids = await asyncio.to_thread(_with_special_tokens, tokenizer, ids)
        else:
            ids = list((await asyncio.to_thread(tokenizer, req.prompt, add_special_tokens=req.add_special_tokens))
                       ["input_ids"])
    except APIError:
        raise
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        raise engine_error(e) from e
    strs = await asyncio.to_thread(tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                            token_strs=None if strs is None else [str(s) for s in strs]).model_dump()


async def detokenize(ctx: ServerContext, req: DetokenizeRequest) -> dict:
    """The ``DetokenizeResponse`` of ``req`` as a dict (``skip_special_tokens`` false, as vLLM).

    Raises:
        APIError: 404 unknown model; 400 a token id outside ``[0, len(tokenizer))`` (named,
            with its index).
    """
    ctx.check_model(req.model)
    tokenizer = ctx.engine.tokenizer
    size = len(tokenizer)
    for i, t in enumerate(req.tokens):
        if not 0 <= t < size:
            raise APIError(400, f"tokens[{i}]: token id {t} is not in this model's vocabulary [0, {size})",
                           f"tokens.{i}", "invalid_token_id")
    text = await asyncio.to_thread(tokenizer.decode, req.tokens)
    return DetokenizeResponse(prompt=text).model_dump()


def add_tokenize_routes(app, ctx: ServerContext, responses) -> None:
    """``POST /tokenize`` and ``POST /detokenize`` on the FastAPI ``app`` (``responses``: the
    server's ``_responses(*statuses)`` for the OpenAPI error statuses)."""
    errors = responses(400, 401, 404, 413, 500, 503)

    def ok(model) -> dict:
        return {**errors, 200: {"description": "OK", "model": model}}

    @app.post("/tokenize", responses=ok(TokenizeResponse))
    async def tokenize_route(body: TokenizeRequest):
        return await tokenize(ctx, body)

    @app.post("/detokenize", responses=ok(DetokenizeResponse))
    async def detokenize_route(body: DetokenizeRequest):
        return await detokenize(ctx, body)
