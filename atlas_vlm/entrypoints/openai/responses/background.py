"""``background: true`` responses (OpenAI's background mode): ``POST /v1/responses`` answers
at once with the response ``queued``; the answer is made by a task on the server's event
loop, exactly as a plain request makes it (``serving.create_response``), and lands in the
store, where ``GET /v1/responses/{id}`` polls it (``in_progress`` -> ``completed`` /
``incomplete`` / ``failed``). ``POST /v1/responses/{id}/cancel`` cancels the task: its engine
request is aborted (blocks freed) and the response ends ``cancelled``."""

from __future__ import annotations

import asyncio
import logging

from atlas_vlm.entrypoints.openai.protocol import APIError, printable
from atlas_vlm.entrypoints.openai.responses.output import item_id, response_object
from atlas_vlm.entrypoints.openai.responses.protocol import ResponsesRequest
from atlas_vlm.entrypoints.openai.responses.serving import create_response
from atlas_vlm.entrypoints.openai.responses.store import UNFINISHED, ResponseStore
from atlas_vlm.entrypoints.openai.responses.translate import FileReader
from atlas_vlm.entrypoints.openai.serving_common import ServerContext

logger = logging.getLogger(__name__)


class BackgroundResponses:
    """The background responses running on ``ctx``'s engine (a ``RoutedContext``: the engine of
    each request's ``model``, held while it runs), kept in ``store``."""

    def __init__(self, ctx: ServerContext, store: ResponseStore):
        self.ctx, self.store = ctx, store
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, req: ResponsesRequest, read_file: FileReader | None) -> dict:
        """Queue ``req``; returns its response object (``status: "queued"``).

        Raises:
            APIError(400): ``store: false`` or ``stream: true`` with ``background`` (OpenAI
                needs the first; this server does not stream background responses); 404 an
                unknown model.
        """
        if not req.store:
            raise APIError(400, "background responses must be stored: drop store=false", "store", "invalid_value")
        if req.stream:
            raise APIError(400, "background responses are not streamed here: poll GET /v1/responses/{id}",
                           "stream", "invalid_value")
        model = self.ctx.check_model(req.model)
        rid = item_id("resp")
        queued = response_object(rid, model, req, status="queued")
        self.store.put(queued, [])
        task = asyncio.get_running_loop().create_task(self._run(req, read_file, queued))
        self.tasks[rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(rid, None))
        return queued

    async def _run(self, req: ResponsesRequest, read_file: FileReader | None, queued: dict) -> None:
        rid = queued["id"]
        self.store.put({**queued, "status": "in_progress"}, [])
        try:
            async with self.ctx.lease(req.model) as ctx:  # several models: ``model`` picks (and holds) its engine
                await create_response(ctx, self.store, req, read_file, rid=rid)  # stores the answer
        except asyncio.CancelledError:
            self.store.put({**queued, "status": "cancelled"}, [])
            raise
        except APIError as e:
            self.store.put({**queued, "status": "failed", "error": {"code": e.code or "server_error",
                                                                    "message": printable(e.message)}}, [])
        except Exception as e:  # noqa: BLE001 - an engine fault fails this response only
            logger.exception("background response %s failed", rid)
            self.store.put({**queued, "status": "failed", "error": {"code": "server_error",
                                                                    "message": printable(str(e))}}, [])

    def cancel(self, rid: str) -> dict:
        """Cancel a background response still queued or running; a finished one is returned
        as it is (OpenAI's behaviour).

        Raises:
            APIError: 404 an unknown id; 400 a response not created with ``background``.
        """
        response = self.store.response(rid)
        if not response.get("background"):
            raise APIError(400, f"response {rid!r} was not created with background=true: only background "
                           "responses can be cancelled", None, "invalid_request")
        task = self.tasks.get(rid)
        if task is None or response["status"] not in UNFINISHED:
            return response
        task.cancel()
        cancelled = {**response, "status": "cancelled"}
        self.store.put(cancelled, [])
        return cancelled

    async def close(self) -> None:
        """Cancel every running background response (server shutdown)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
