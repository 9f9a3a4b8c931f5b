"""The Anthropic routes on the server's FastAPI app (kept apart so ``api_server`` stays small)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from atlas_vlm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from atlas_vlm.entrypoints.anthropic.serving import count_tokens, create_message
from atlas_vlm.entrypoints.openai.protocol import SSE_NAMED_EVENT_SCHEMA
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, until_disconnected


ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}




def anthropic_openapi_responses(responses: dict, stream: bool) -> dict:
    """``responses`` (the chat route's OpenAPI responses) with Anthropic's error JSON as the
    schema of every error status, and named events as the SSE schema (JSON only unless
    ``stream``)."""
    out = dict(responses)
    for status in out:
        if status != 200:
            out[status] = {**out[status], "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    content = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        content["text/event-stream"] = {"schema": SSE_NAMED_EVENT_SCHEMA}  # message_start ...
    out[200] = {**out[200], "content": content}
    return out


def add_anthropic_routes(app: FastAPI, ctx: ServerContext, respond, responses: dict) -> None:
    """Add ``POST /v1/messages`` (JSON or SSE through ``respond``, as chat completions) and
    ``POST /v1/messages/count_tokens``; ``responses``: the chat route's OpenAPI responses,
    declared here with Anthropic's error JSON, which these paths answer (``api_server._error``)."""

    @app.post("/v1/messages", responses=anthropic_openapi_responses(responses, stream=True))
    async def messages(body: MessagesRequest, raw: Request):
        return respond(await until_disconnected(create_message(ctx, body), raw.receive))

    @app.post("/v1/messages/count_tokens", responses=anthropic_openapi_responses(responses, stream=False))
    async def messages_count_tokens(body: CountTokensRequest, raw: Request):
        return respond(await until_disconnected(count_tokens(ctx, body), raw.receive))
