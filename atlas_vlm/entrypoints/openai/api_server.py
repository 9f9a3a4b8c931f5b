"""The OpenAI-compatible HTTP server: FastAPI app factory and the uvicorn runner.

Routes only translate HTTP to the serving functions and back; engine work happens in
``AsyncLLM``. Every answer that is not a success is OpenAI's JSON (``protocol.APIError``),
whatever the input's bytes: a malformed body is 400 (never FastAPI's 422), an unknown route
404, a wrong method 405 with ``Allow``, a body over ``--max-request-body-bytes`` (a
``/v1/files`` upload: ``--max-file-bytes``) 413, a failed engine step 500, busy or
unavailable 503 with ``Retry-After``, anything unexpected 500. ``--api-key`` guards ``/v1/*``, ``/tokenize`` and
``/detokenize`` (401; compared in constant time); with
``protect_docs_metrics`` also ``/docs``, ``/redoc``, ``/openapi.json`` and ``/metrics``;
``/health`` and the chat page at ``/`` (``entrypoints/web``) stay open. The OpenAPI schema
declares what the routes answer (JSON or SSE, the error statuses, ``text/plain`` metrics).

Faults and shutdown: a client gone while its request is prepared or queued drops it before
prefill; a failed engine step fails the requests in flight and the engine is reset; an engine
declared dead stops the server with exit code 1 (a supervisor restarts it). SIGTERM/SIGINT:
stop admitting, end every stream at once with ``finish_reason: "abort"`` and ``[DONE]``
(even during a long step), let uvicorn close, wait for the engine thread, exit 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from atlas_vlm.engine.request_stream import EngineDeadError, EngineStepError
from atlas_vlm.entrypoints.anthropic.routes import add_anthropic_routes
from atlas_vlm.entrypoints.openai.access_log import AccessLogMiddleware
from atlas_vlm.entrypoints.openai.batch.files import FileStore
from atlas_vlm.entrypoints.openai.batch.jobs import DEFAULT_BATCH_IN_FLIGHT, BatchJobs
from atlas_vlm.entrypoints.openai.batch.routes import FILES_PATH, add_batch_routes
from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from atlas_vlm.entrypoints.openai.model_card import model_card, model_card_schema, model_info
from atlas_vlm.entrypoints.openai.middleware import (APIKeyMiddleware, BodyLimitMiddleware, error_response,
                                                     default_max_request_body_bytes)
from atlas_vlm.entrypoints.openai.responses.routes import add_responses_routes
from atlas_vlm.entrypoints.openai.responses.store import ResponseStore
from atlas_vlm.entrypoints.openai.serving_chat import create_chat_completion
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, engine_error, until_disconnected
from atlas_vlm.entrypoints.openai.serving_completion import create_completion
from atlas_vlm.entrypoints.openai.serving_embedding import EmbeddingRequest, create_embedding
from atlas_vlm.entrypoints.openai.serving_tokenize import add_tokenize_routes
from atlas_vlm.entrypoints.web import add_web_routes

logger = logging.getLogger(__name__)
UPLOAD_MARGIN_BYTES = 64 * 1024  # multipart framing and the form's other fields around an uploaded file

def _error_schema() -> dict:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _responses(*statuses: int, stream: bool = False) -> dict:
    """OpenAPI ``responses`` of a route: 200 (JSON, and SSE when it can stream) and the
    OpenAI error JSON for each status."""
    ok = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        # one event, as OpenAPI before 3.2 reads an event stream's schema: its ``data`` a chunk's JSON (or [DONE])
        ok["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                              "properties": {"data": {"type": "string"}}}}
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}
    words = {400: "bad input", 401: "missing or wrong API key", 404: "unknown model", 413: "body too large",
             500: "engine fault", 503: "busy or unavailable"}
    return {200: {"description": "OK", "content": ok},
            **{s: {"description": words.get(s, "error"), "content": err} for s in statuses}}


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (a path served by several
    routes, one per method, e.g. ``GET`` and ``POST /v1/batches``), sorted."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI's JSON for every error out of ``app``'s routes (see ``create_app``)."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return error_response(validation_error(list(e.errors())), request.url.path)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return error_response(engine_error(e), request.url.path)

    @app.exception_handler(EngineStepError)
    async def _step_failed(request: Request, e: EngineStepError):
        return error_response(engine_error(e), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        headers = e.headers
        if e.status_code == 405:  # every method of the path, not only those of the route that matched first
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return error_response(APIError(e.status_code, str(e.detail), None, getattr(e, "code", None), headers=headers),
                      request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error ({type(e).__name__})", None, "internal_error"),
                      request.url.path)


def install_middlewares(app: FastAPI, api_key: str | None, protect_docs_metrics: bool, access_log: bool,
                        max_request_body_bytes: int | None, body_overrides: dict | None = None) -> None:
    """The API key guard, the body size limit (``body_overrides``: per-path limits) and the
    access log (outermost) of ``app`` (see ``create_app``)."""
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protect_docs_metrics=protect_docs_metrics)
    if max_request_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, limit=max_request_body_bytes,
                           overrides=body_overrides or {})
    if access_log:  # added last: outermost, so the other middlewares' refusals are logged too
        app.add_middleware(AccessLogMiddleware)


def install_openapi(app: FastAPI) -> None:
    """``app``'s OpenAPI schema: FastAPI's, with OpenAI's error and the model card declared."""
    def openapi() -> dict:
        """FastAPI's schema, with the 422 it adds to every body route replaced by what the
        server answers instead (400, OpenAI's error JSON)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            comps["OpenAIError"] = _error_schema()
            comps["Model"] = model_card_schema()
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def create_app(ctx: ServerContext, registry, api_key: str | None = None, metrics_text=None, *,
               max_request_body_bytes: int | None = None, protect_docs_metrics: bool = False,
               files: FileStore | None = None, batch_max_in_flight: int = DEFAULT_BATCH_IN_FLIGHT,
               responses_store=None, access_log: bool = True) -> FastAPI:
    """FastAPI app over ``ctx`` (engine front + settings); ``registry`` is the Prometheus
    ``CollectorRegistry`` served at ``/metrics``, unless ``metrics_text`` (an async
    ``() -> str`` in Prometheus text format; the Ray ingress aggregates its replicas) is given.

    Args:
        max_request_body_bytes: 413 above this many body bytes (None: no limit).
        protect_docs_metrics: with ``api_key``, also guard ``/docs``, ``/redoc``,
            ``/openapi.json`` and ``/metrics``.
        files: the ``/v1/files`` store (default: a temporary directory removed at shutdown);
            an upload is bounded by its ``max_file_bytes`` instead of ``max_request_body_bytes``.
        batch_max_in_flight: lines of one ``/v1/batches`` batch running at once.
        responses_store: ``/v1/responses``' ``ResponseStore`` (default: in memory).
        access_log: write one ``access_log`` line per request (outermost middleware).

    An ``EngineDeadError`` out of a route (the engine or a replica died mid-request) is 503,
    an ``EngineStepError`` (a failed step) 500, any other exception 500; all OpenAI JSON.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    files = files if files is not None else FileStore()
    jobs = BatchJobs(ctx, files, batch_max_in_flight)

    @contextlib.asynccontextmanager
    async def lifespan(_app):  # at shutdown: running batches cancelled (results kept), a temporary store removed
        yield
        await background.close()
        await jobs.close()
        files.close()

    app = FastAPI(title="Atlas VLM OpenAI-compatible server", lifespan=lifespan)
    created = int(time.time())

    install_error_handlers(app)
    install_middlewares(app, api_key, protect_docs_metrics, access_log, max_request_body_bytes,
                        {FILES_PATH: (files.max_file_bytes + UPLOAD_MARGIN_BYTES, "--max-file-bytes")})

    def _card(name: str) -> dict:
        return model_card(name, created, ctx.max_model_len, ctx.model_info, ctx.is_vlm)

    health_responses = {200: {"description": "serving", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"type": "string"}}}}}},
        503: {"description": "shutting down or engine dead",
              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}}

    @app.get("/health", responses=health_responses, response_class=JSONResponse)
    async def health():
        if ctx.engine.alive:
            return JSONResponse({"status": "ok"})
        return error_response(APIError(503, "the engine is not serving (shutting down or dead)", None, "engine_unavailable"))

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {
                 "schema": {"type": "string"}}}}, **({401: _responses(401)[401]} if protect_docs_metrics else {})})
    async def metrics():
        text = await metrics_text() if metrics_text is not None else generate_latest(registry)
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    card_ref = {"$ref": "#/components/schemas/Model"}

    def _ok(schema: dict) -> dict:
        return {"description": "OK", "content": {"application/json": {"schema": schema}}}

    @app.get("/v1/models", responses={**_responses(401), 200: _ok({
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": card_ref}}})})
    async def models():
        return {"object": "list", "data": [_card(name) for name in ctx.model_names]}

    @app.get("/v1/models/{model_id:path}", responses={**_responses(401, 404), 200: _ok(card_ref)})
    async def model(model_id: str):
        return _card(model_id if model_id in ctx.model_names else ctx.check_model(model_id))

    def _respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    errors = (400, 401, 404, 413, 500, 503)

    @app.post("/v1/chat/completions", responses=_responses(*errors, stream=True))
    async def chat(body: ChatCompletionRequest, raw: Request):
        return _respond(await until_disconnected(create_chat_completion(ctx, body), raw.receive))

    @app.post("/v1/completions", responses=_responses(*errors, stream=True))
    async def completions(body: CompletionRequest, raw: Request):
        return _respond(await until_disconnected(create_completion(ctx, body), raw.receive))

    @app.post("/v1/embeddings", responses=_responses(*errors))
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return _respond(await until_disconnected(create_embedding(ctx, body), raw.receive))

    background = add_responses_routes(app, ctx, _respond, _responses, store=responses_store, files=files)

    add_anthropic_routes(app, ctx, _respond, _responses(*errors, stream=True))

    add_batch_routes(app, files, jobs, _responses)
    if getattr(ctx.engine, "engine", None) is not None:  # a local engine: its tokenizer (not the Ray ingress)
        add_tokenize_routes(app, ctx, _responses)
    add_web_routes(app)  # the chat page at / (its requests go to the guarded /v1 routes)

    install_openapi(app)
    return app


def server_context(engine, front, engine_config, served_model_names=None, media=None,
                   max_prompts_per_request: int = 64) -> ServerContext:
    """The routes' ``ServerContext`` over a built ``LLMEngine`` and its ``AsyncLLM`` front
    (``served_model_names`` default: ``served_name.default_served_model_name`` of the model;
    ``media`` default: the engine's ``MediaFetchPolicy`` with no local files); its
    ``model_info`` feeds the ``/v1/models`` cards (``model_card``)."""
    from atlas_vlm.entrypoints.openai.media import MediaPolicy
    from atlas_vlm.tool_parsers import resolve_tool_parser

    from atlas_vlm.entrypoints.openai.served_name import default_served_model_name

    model_config = engine_config.model_config
    media = media or MediaPolicy.over(engine_config.multimodal_config.media)
    is_vlm = hasattr(engine.hf_config, "vision_config")
    tool_parser = resolve_tool_parser(model_config.tool_call_parser, getattr(engine.tokenizer, "chat_template", None))
    info = model_info(engine, engine_config, is_vlm=is_vlm, reasoning_parser=engine.reasoning_parser,
                      tool_parser=tool_parser if model_config.tool_call_parser else None)
    return ServerContext(front, served_model_names or [default_served_model_name(model_config.model)], is_vlm,
                         media, engine.max_model_len, max_prompts_per_request=max_prompts_per_request,
                         model_root=str(model_config.model), reasoning_parser=engine.reasoning_parser,
                         tool_parser=tool_parser, model_info=info)


def one_media_policy(engine_config, media=None):
    """``(engine_config, media)`` sharing one ``MediaFetchPolicy``: without ``media`` the
    server's ``MediaPolicy`` is the engine's ``multimodal_config.media`` (no local files);
    with it, a copy of ``engine_config`` takes ``media``'s fetch fields, so the engine's own
    downloads obey what the server's do."""
    from atlas_vlm.entrypoints.openai.media import MediaPolicy

    if media is None:
        return engine_config, MediaPolicy.over(engine_config.multimodal_config.media)
    mm = dataclasses.replace(engine_config.multimodal_config, media=media.fetch_policy())
    return dataclasses.replace(engine_config, multimodal_config=mm), media


def run_server(engine_config, server_config=None) -> int:
    """Build the engine of ``engine_config`` (an ``EngineConfig``) and serve it with
    ``server_config`` (a ``ServerConfig``: address, key, limits, stores, logs; None: its
    defaults) until SIGTERM/SIGINT, then shut down cleanly. The server's ``MediaPolicy`` is the
    engine's ``multimodal_config.media`` plus ``server_config.allowed_local_media_path``, one
    policy for both (``one_media_policy``); the served names default to the model's
    (``default_served_model_name``).

    Returns:
        0 after a signal; 1 if the engine was declared dead (repeated step failures), so a
        supervisor restarts the process instead of a server that answers 503 forever.

    Raises:
        ModelNotFoundError, UnsupportedModelError, KVBudgetError, ValueError: engine set-up.
    """
    import uvicorn

    from atlas_vlm.engine import LLMEngine
    from atlas_vlm.engine.async_llm import AsyncLLM
    from atlas_vlm.entrypoints.openai.metrics import PrometheusStatLogger
    from atlas_vlm.entrypoints.openai.stat_logging import LoggingStatLogger, StatLoggers, log_startup
    from atlas_vlm.config.server import ServerConfig
    from atlas_vlm.entrypoints.openai.media import MediaPolicy
    from atlas_vlm.entrypoints.openai.served_name import default_served_model_name

    sc = ServerConfig() if server_config is None else server_config
    media = MediaPolicy.over(engine_config.multimodal_config.media, allowed_local_media_path=sc.allowed_local_media_path)
    engine_config, media = one_media_policy(engine_config, media)
    max_request_body_bytes = sc.max_request_body_bytes
    if max_request_body_bytes is None:
        max_request_body_bytes = default_max_request_body_bytes(media.max_image_bytes)
    served_model_names = sc.served_model_name or [default_served_model_name(str(engine_config.model_config.model))]
    shutdown_timeout_s = sc.shutdown_timeout_s
    log_stats = LoggingStatLogger(sc.log_stats_interval_s) if sc.log_stats_interval_s else None
    engine = LLMEngine(engine_config)
    stat_logger = PrometheusStatLogger()
    exit_code = {"code": 0}
    server_ref: dict = {}

    def on_dead(error: BaseException) -> None:  # engine thread: stop serving, exit 1
        exit_code["code"] = 1
        server = server_ref.get("server")
        if server is not None:
            server.should_exit = True

    front = AsyncLLM(engine, max_waiting_requests=sc.max_waiting_requests,
                     stat_logger=StatLoggers(stat_logger, log_stats), input_workers=sc.input_workers, on_dead=on_dead)
    stat_logger.attach(front)
    ctx = server_context(engine, front, engine_config, served_model_names, media, sc.max_prompts_per_request)
    app = create_app(ctx, stat_logger.registry, sc.api_key, max_request_body_bytes=max_request_body_bytes,
                     protect_docs_metrics=sc.protect_docs_metrics, files=FileStore(sc.files_dir, sc.max_file_bytes),
                     batch_max_in_flight=sc.max_batch_concurrency,
                     responses_store=ResponseStore(sc.max_stored_responses, sc.responses_dir),
                     access_log=sc.access_log)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # first signal: stop admitting, end every stream now
            front.shutdown()
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, host=sc.host, port=sc.port, log_level=sc.log_level,
                                    timeout_graceful_shutdown=shutdown_timeout_s, access_log=False))
    server_ref["server"] = server
    # uvicorn re-raises a captured signal after shutdown with the handlers it found; make those no-ops so the
    # process exits 0 after a graceful stop instead of dying by the signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    log_startup(sc.host, sc.port, str(engine_config.model_config.model), ctx.model_names,
                ctx.model_info is not None and ctx.model_info.random_weights)
    if log_stats is not None:
        log_stats.start(front)
    server.run()
    if log_stats is not None:
        log_stats.stop()
    front.shutdown()
    if not front.join(timeout=shutdown_timeout_s):
        # the engine thread is still inside one step: leaving through interpreter shutdown with it running
        # would abort the process (torch's threads); every stream has ended already, so leave at once
        logger.warning("engine step still running %.0f s after shutdown; exiting without waiting", shutdown_timeout_s)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code["code"])
    return exit_code["code"]
