"""The model-taking routes of the several-model server (issue 36, item 1): each request's
``model`` picks the engine (``ModelRouter.acquire``: loaded first if needed, held until the
answer or its stream ends), then the same serving function as the single-model server's
route answers it.

Routed: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/messages``
and ``/v1/messages/count_tokens`` (Anthropic), ``/tokenize`` and ``/detokenize``,
``/v1/responses`` (stored responses shared by every model: ``GET`` / ``DELETE`` / ``cancel``
by id, and ``previous_response_id`` may continue a conversation on another model;
``background: true`` holds its model while it runs), and ``/v1/files`` + ``/v1/batches``
(each batch line's ``model`` picks its engine: ``ServerContext.lease`` /
``RoutedContext.lease``). An unknown ``model`` is a 404 naming it and listing the served
models on every one of them; a missing one a 400.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from atlas_vlm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from atlas_vlm.entrypoints.anthropic.routes import anthropic_openapi_responses
from atlas_vlm.entrypoints.anthropic.serving import count_tokens, create_message
from atlas_vlm.entrypoints.openai.batch.jobs import BatchJobs
from atlas_vlm.entrypoints.openai.batch.routes import add_batch_routes
from atlas_vlm.entrypoints.openai.model_router import ModelRouter
from atlas_vlm.entrypoints.openai.protocol import SSE_NAMED_EVENT_SCHEMA, ChatCompletionRequest, CompletionRequest
from atlas_vlm.entrypoints.openai.responses.background import BackgroundResponses
from atlas_vlm.entrypoints.openai.responses.protocol import ResponsesRequest
from atlas_vlm.entrypoints.openai.responses.routes import add_stored_response_routes, file_reader
from atlas_vlm.entrypoints.openai.responses.serving import create_response
from atlas_vlm.entrypoints.openai.serving_chat import create_chat_completion
from atlas_vlm.entrypoints.openai.serving_common import until_disconnected
from atlas_vlm.entrypoints.openai.serving_completion import create_completion
from atlas_vlm.entrypoints.openai.serving_embedding import EmbeddingRequest, create_embedding
from atlas_vlm.entrypoints.openai.serving_tokenize import (DetokenizeRequest, TokenizeRequest, TokenizeResponse,
                                                           DetokenizeResponse, detokenize, tokenize)


class RoutedContext:
    """What ``BatchJobs`` and ``BackgroundResponses`` hold in place of one ``ServerContext``
    on a several-model server: ``check_model`` and ``lease`` over a ``ModelRouter``."""

    def __init__(self, router: ModelRouter):
        self.router = router

    def check_model(self, name: str | None) -> str:
        """The served name of a request's ``model``; raises as ``ModelRouter.slot`` (400 / 404)."""
        return self.router.slot(name).spec.name

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None):
        """``async with routed.lease(model) as ctx``: the model's ``ServerContext``, loaded
        first if needed and held until the block ends; raises as ``ModelRouter.acquire``."""
        ctx = await self.router.acquire(name)
        try:
            yield ctx
        finally:
            self.router.release(name)


def add_routed_routes(app: FastAPI, router: ModelRouter, responses, *, files, store,
                      batch_max_in_flight: int) -> tuple[BackgroundResponses, BatchJobs]:
    """Add the routes of the module docstring to ``app``.

    Args:
        responses: the app's ``(*statuses, stream=False) -> OpenAPI responses``.
        files: the ``/v1/files`` ``FileStore`` (batch inputs and results, ``input_file`` parts).
        store: the ``/v1/responses`` ``ResponseStore``.
        batch_max_in_flight: lines of one batch running at once.

    Returns:
        ``(background responses, batch jobs)``: the app ``close()``s both at shutdown.
    """

    async def _released(stream, name: str):
        try:
            async for chunk in stream:
                yield chunk
        finally:
            router.release(name)

    async def serve(create, body, raw: Request):
        """``create(ctx, body)`` on the engine of ``body.model``: a dict as JSON, an async
        iterator as SSE (the model held until the stream ends)."""
        ctx = await router.acquire(body.model)
        try:
            result = await until_disconnected(create(ctx, body), raw.receive)
        except BaseException:
            router.release(body.model)
            raise
        if isinstance(result, dict):
            router.release(body.model)
            return JSONResponse(result)
        return StreamingResponse(_released(result, body.model), media_type="text/event-stream")

    def post(path: str, body_type, create, openapi: dict) -> None:
        async def route(body, raw: Request):
            return await serve(create, body, raw)

        route.__annotations__ = {"body": body_type, "raw": Request}  # FastAPI reads the body's model from here
        route.__name__ = path.strip("/").replace("/", "_")
        app.post(path, responses=openapi)(route)

    errors = (400, 401, 404, 413, 500, 503)
    chat_openapi = responses(*errors, stream=True)
    post("/v1/chat/completions", ChatCompletionRequest, create_chat_completion, chat_openapi)
    post("/v1/completions", CompletionRequest, create_completion, responses(*errors, stream=True))
    post("/v1/embeddings", EmbeddingRequest, create_embedding, responses(*errors))
    post("/v1/messages", MessagesRequest, create_message, anthropic_openapi_responses(chat_openapi, stream=True))
    post("/v1/messages/count_tokens", CountTokensRequest, count_tokens,
         anthropic_openapi_responses(chat_openapi, stream=False))
    post("/tokenize", TokenizeRequest, tokenize, {**responses(*errors), 200: {"description": "OK",
                                                                            "model": TokenizeResponse}})
    post("/detokenize", DetokenizeRequest, detokenize, {**responses(*errors), 200: {"description": "OK",
                                                                                  "model": DetokenizeResponse}})

    read_file = file_reader(files)
    routed = RoutedContext(router)
    background = BackgroundResponses(routed, store)  # each response ``lease``s its model
    created = responses(*errors, stream=True)
    created[200]["content"]["text/event-stream"] = {"schema": SSE_NAMED_EVENT_SCHEMA}

    @app.post("/v1/responses", responses=created)
    async def create(body: ResponsesRequest, raw: Request):
        if body.background:
            return background.start(body, read_file)
        return await serve(lambda ctx, req: create_response(ctx, store, req, read_file), body, raw)

    add_stored_response_routes(app, store, background, responses)
    jobs = BatchJobs(routed, files, batch_max_in_flight)  # each line ``lease``s its model
    add_batch_routes(app, files, jobs, responses)
    return background, jobs
