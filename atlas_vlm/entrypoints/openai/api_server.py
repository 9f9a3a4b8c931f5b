"""The OpenAI-compatible HTTP server: FastAPI app factory and the uvicorn runner.

Routes only translate HTTP to the serving functions and back; engine work happens in
``AsyncLLM``. Errors are OpenAI's JSON (``protocol.APIError``): a malformed body is 400
(never FastAPI's 422), an unknown route 404. ``--api-key`` guards ``/v1/*`` (401);
``/health`` and ``/metrics`` stay open, as in vLLM. Shutdown on SIGTERM/SIGINT: stop
admitting, abort in-flight requests (their streams end), let uvicorn close, exit 0.
"""

from __future__ import annotations

import logging
import signal
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from atlas_vlm.engine.request_stream import EngineDeadError
from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from atlas_vlm.entrypoints.openai.serving_chat import create_chat_completion
from atlas_vlm.entrypoints.openai.serving_common import ServerContext
from atlas_vlm.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger(__name__)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _APIKeyMiddleware:
    """Plain ASGI middleware (not ``BaseHTTPMiddleware``, which wraps ``receive`` and hides a
    client's disconnect from the routes): 401 on ``/v1/*`` without ``Bearer KEY``."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", None,
                               "invalid_api_key")
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(ctx: ServerContext, registry, api_key: str | None = None, metrics_text=None) -> FastAPI:
    """FastAPI app over ``ctx`` (engine front + settings); ``registry`` is the Prometheus
    ``CollectorRegistry`` served at ``/metrics``, unless ``metrics_text`` (an async
    ``() -> str`` in Prometheus text format; the Ray ingress aggregates its replicas) is given.
    An ``EngineDeadError`` out of a route (the engine or a replica died mid-request) is 503."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="Atlas VLM OpenAI-compatible server")
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _error(validation_error(list(e.errors())))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return _error(APIError(503, str(e), None, "engine_unavailable"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        return _error(APIError(e.status_code, str(e.detail), None, None))

    if api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if ctx.engine.alive else 503)

    @app.get("/metrics")
    async def metrics():
        text = await metrics_text() if metrics_text is not None else generate_latest(registry)
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "atlas-vlm",
                                            "max_model_len": ctx.max_model_len} for name in ctx.model_names]}

    def _respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        return _respond(await create_chat_completion(ctx, body, raw.is_disconnected))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return _respond(await create_completion(ctx, body, raw.is_disconnected))

    return app


def run_server(engine_config, *, host: str = "127.0.0.1", port: int = 8000, served_model_names=None,
               api_key: str | None = None, max_waiting_requests: int | None = None, media=None,
               log_level: str = "info") -> int:
    """Build the engine, serve until SIGTERM/SIGINT, shut down cleanly; returns the exit code 0.

    Raises:
        ModelNotFoundError, UnsupportedModelError, KVBudgetError, ValueError: engine set-up.
    """
    import uvicorn

    from atlas_vlm.engine import LLMEngine
    from atlas_vlm.engine.async_llm import AsyncLLM
    from atlas_vlm.entrypoints.openai.media import MediaPolicy
    from atlas_vlm.entrypoints.openai.metrics import PrometheusStatLogger

    engine = LLMEngine(engine_config)
    stat_logger = PrometheusStatLogger()
    front = AsyncLLM(engine, max_waiting_requests=max_waiting_requests, stat_logger=stat_logger)
    stat_logger.attach(front)
    ctx = ServerContext(front, served_model_names or [engine_config.model], hasattr(engine.hf_config, "vision_config"),
                        media or MediaPolicy(), engine.max_model_len, reasoning_parser=engine.reasoning_parser)
    app = create_app(ctx, stat_logger.registry, api_key)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # first signal: stop admitting, end every stream now
            front.shutdown()
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
                                    access_log=False))
    # uvicorn re-raises a captured signal after shutdown with the handlers it found; make those no-ops so the
    # process exits 0 after a graceful stop instead of dying by the signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s as %s on http://%s:%d", engine_config.model, ctx.model_names, host, port)
    server.run()
    front.shutdown()
    front.join(timeout=10)
    return 0
