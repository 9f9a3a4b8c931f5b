"""The ``/v1/responses`` routes on the server's FastAPI app: create (JSON, SSE, or in the
background), retrieve, delete and cancel a stored response."""

from __future__ import annotations

from fastapi import FastAPI, Request

from atlas_vlm.entrypoints.openai.protocol import SSE_NAMED_EVENT_SCHEMA
from atlas_vlm.entrypoints.openai.responses.background import BackgroundResponses
from atlas_vlm.entrypoints.openai.responses.protocol import ResponsesRequest
from atlas_vlm.entrypoints.openai.responses.serving import create_response
from atlas_vlm.entrypoints.openai.responses.store import ResponseStore
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, until_disconnected


def file_reader(files):
    """``translate.FileReader`` over the ``/v1/files`` store ``files`` (None: no store)."""
    if files is None:
        return None

    def read(file_id: str, param: str) -> tuple[bytes, str]:
        obj = files.get(file_id, param)  # APIError(404) naming param
        return files.path(file_id, param).read_bytes(), obj["filename"]

    return read


def add_stored_response_routes(app: FastAPI, store: ResponseStore, background: BackgroundResponses,
                               responses) -> None:
    """Add ``GET`` / ``DELETE /v1/responses/{response_id}`` and ``POST
    /v1/responses/{response_id}/cancel`` on ``store`` and ``background`` (one server's or a
    several-model router's: a stored response does not depend on which model made it)."""

    @app.get("/v1/responses/{response_id}", responses=responses(401, 404))
    async def retrieve(response_id: str):
        return store.response(response_id)

    @app.delete("/v1/responses/{response_id}", responses=responses(401, 404))
    async def delete(response_id: str):
        return store.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=responses(400, 401, 404))
    async def cancel(response_id: str):
        return background.cancel(response_id)


def add_responses_routes(app: FastAPI, ctx: ServerContext, respond, responses, *,
                         store: ResponseStore | None = None, files=None) -> BackgroundResponses:
    """Add ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{response_id}`` and
    ``POST /v1/responses/{response_id}/cancel`` to ``app``.

    Args:
        respond: the app's ``result -> Response`` (a dict as JSON, an iterator as SSE).
        responses: the app's ``(*statuses, stream=False) -> OpenAPI responses``.
        store: where stored responses live (default: a new in-memory ``ResponseStore``).
        files: the ``/v1/files`` store ``input_file`` parts' ``file_id`` are read from.

    Returns:
        The background responses (their ``store``; ``close()`` at shutdown).
    """
    store = store if store is not None else ResponseStore()
    read_file = file_reader(files)
    background = BackgroundResponses(ctx, store)

    created = responses(400, 401, 404, 413, 500, 503, stream=True)
    created[200]["content"]["text/event-stream"] = {"schema": SSE_NAMED_EVENT_SCHEMA}  # response.created ...

    @app.post("/v1/responses", responses=created)
    async def create(body: ResponsesRequest, raw: Request):
        if body.background:
            return background.start(body, read_file)
        return respond(await until_disconnected(create_response(ctx, store, body, read_file), raw.receive))

    add_stored_response_routes(app, store, background, responses)
    return background
