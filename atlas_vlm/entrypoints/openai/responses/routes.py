"""The ``/v1/responses`` routes on the server's FastAPI app: create (JSON or SSE), retrieve
and delete a stored response."""

from __future__ import annotations

from fastapi import FastAPI, Request

from atlas_vlm.entrypoints.openai.responses.protocol import ResponsesRequest
from atlas_vlm.entrypoints.openai.responses.serving import create_response
from atlas_vlm.entrypoints.openai.responses.store import ResponseStore
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, until_disconnected


def add_responses_routes(app: FastAPI, ctx: ServerContext, respond, responses, *,
                         store: ResponseStore | None = None) -> ResponseStore:
    """Add ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}`` to ``app``.

    Args:
        respond: the app's ``result -> Response`` (a dict as JSON, an iterator as SSE).
        responses: the app's ``(*statuses, stream=False) -> OpenAPI responses``.
        store: where stored responses live (default: a new ``ResponseStore``).

    Returns:
        The store (a route answers 404 for an id it does not hold).
    """
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses", responses=responses(400, 401, 404, 413, 500, 503, stream=True))
    async def create(body: ResponsesRequest, raw: Request):
        return respond(await until_disconnected(create_response(ctx, store, body), raw.receive))

    @app.get("/v1/responses/{response_id}", responses=responses(401, 404))
    async def retrieve(response_id: str):
        return store.response(response_id)

    @app.delete("/v1/responses/{response_id}", responses=responses(401, 404))
    async def delete(response_id: str):
        return store.delete(response_id)

    return store
