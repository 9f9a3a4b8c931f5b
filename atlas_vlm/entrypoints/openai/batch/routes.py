"""The ``/v1/files`` and ``/v1/batches`` routes on the server's FastAPI app (OpenAI's API:
upload / list / retrieve / content / delete a file; create / retrieve / list / cancel a batch).
Uploads are ``multipart/form-data`` (``file`` and ``purpose``), parsed by FastAPI's form
support (``python-multipart``), the file part spooled to disk, never held whole in memory."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, File, Form, Query, UploadFile
from fastapi.responses import FileResponse
from pydantic import Field

from atlas_vlm.entrypoints.openai.batch.files import UPLOAD_PURPOSES, FileStore
from atlas_vlm.entrypoints.openai.batch.jobs import COMPLETION_WINDOWS, BatchJobs
from atlas_vlm.entrypoints.openai.batch.lines import ENDPOINT_URLS
from atlas_vlm.entrypoints.openai.protocol import UnicodeBody

FILES_PATH = "/v1/files"  # uploads here are bounded by --max-file-bytes, not --max-request-body-bytes


class BatchRequest(UnicodeBody):
    """``POST /v1/batches``: OpenAI's create-batch body."""

    input_file_id: str
    # the values served, stated in the schema (the store names them in its 400 for any other)
    endpoint: str = Field(json_schema_extra={"enum": list(ENDPOINT_URLS)})
    completion_window: str = Field(json_schema_extra={"enum": list(COMPLETION_WINDOWS)})
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def add_batch_routes(app: FastAPI, files: FileStore, jobs: BatchJobs, responses) -> None:
    """Add the files and batches routes to ``app``.

    Args:
        files: the file store (uploads, batch results).
        jobs: the batches, run on the server's engine.
        responses: the app's ``(*statuses, stream=False) -> OpenAPI responses``.
    """
    content = {200: {"description": "the file's bytes", "content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}}}}
    content.update({s: v for s, v in responses(401, 404).items() if s != 200})

    @app.post(FILES_PATH, responses=responses(400, 401, 413))
    async def upload_file(file: UploadFile = File(..., json_schema_extra={"minLength": 1}),
                          purpose: str = Form(..., json_schema_extra={"enum": list(UPLOAD_PURPOSES)})):
        return await files.upload(file, purpose)

    @app.get(FILES_PATH, responses=responses(400, 401))
    async def list_files(purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                         after: str | None = None, order: Literal["asc", "desc"] = "desc"):
        return files.list(purpose, limit, after, order)

    @app.get(FILES_PATH + "/{file_id}", responses=responses(401, 404))
    async def retrieve_file(file_id: str):
        return files.get(file_id)

    @app.get(FILES_PATH + "/{file_id}/content", responses=content, response_class=FileResponse)
    async def file_content(file_id: str):
        obj = files.get(file_id)
        return FileResponse(files.path(file_id), media_type="application/octet-stream", filename=obj["filename"])

    @app.delete(FILES_PATH + "/{file_id}", responses=responses(401, 404))
    async def delete_file(file_id: str):
        return files.delete(file_id)

    @app.post("/v1/batches", responses=responses(400, 401, 404, 413))
    async def create_batch(body: BatchRequest):
        return jobs.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata)

    @app.get("/v1/batches", responses=responses(400, 401))
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None):
        return jobs.list(limit, after)

    @app.get("/v1/batches/{batch_id}", responses=responses(401, 404))
    async def retrieve_batch(batch_id: str):
        return jobs.get(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", responses=responses(401, 404, 409))
    async def cancel_batch(batch_id: str):
        return jobs.cancel(batch_id)
