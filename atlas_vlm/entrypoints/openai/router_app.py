"""The several-model server (issue 36, item 1): the FastAPI app over a ``ModelRouter`` and
its uvicorn runner. ``atlas-vlm serve --model A --model B`` / ``--models-dir`` start it; one
model is the single-model server (``api_server``), unchanged.

Routes: every model-taking route (``router_routes``: chat, completions, embeddings,
responses, Anthropic messages, tokenize, files and batches) answers with the engine its
``model`` names (loaded first if needed); ``/v1/models`` lists every model with
``status`` (``loaded`` / ``loading`` / ``unloaded``; a loaded one with its full card);
``POST /models/load`` and ``POST /models/unload`` (llama-server's router routes, body
``{"model": NAME}``); ``/metrics`` has each resident model's metrics with a ``model_name``
label; ``/health`` and the chat page as in the single-model server. Errors, the API key and
body limits as ``api_server.create_app``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from atlas_vlm.entrypoints.openai.api_server import (UPLOAD_MARGIN_BYTES, _responses, install_error_handlers,
                                                     install_middlewares, install_openapi)
from atlas_vlm.entrypoints.openai.batch.files import DEFAULT_MAX_FILE_BYTES, FileStore
from atlas_vlm.entrypoints.openai.batch.jobs import DEFAULT_BATCH_IN_FLIGHT
from atlas_vlm.entrypoints.openai.batch.routes import FILES_PATH
from atlas_vlm.entrypoints.openai.model_card import model_card
from atlas_vlm.entrypoints.openai.model_router import ModelRouter
from atlas_vlm.entrypoints.openai.responses.store import ResponseStore
from atlas_vlm.entrypoints.openai.router_routes import add_routed_routes
from atlas_vlm.entrypoints.web import add_web_routes

logger = logging.getLogger(__name__)


class ModelAction(BaseModel):
    """Body of ``POST /models/load`` and ``/models/unload``."""

    model: str


def metrics_text(router: ModelRouter) -> bytes:
    """Prometheus text of every resident model's registry, each sample labelled
    ``model_name`` (families of one name merged, so each is declared once)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for name, loaded in router.loaded().items():
        for fam in loaded.registry.collect():
            merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
            merged.samples.extend(Sample(s.name, {"model_name": name, **s.labels}, s.value, s.timestamp, s.exemplar)
                                  for s in fam.samples)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


def create_router_app(router: ModelRouter, api_key: str | None = None, *, max_request_body_bytes: int | None = None,
                      protect_docs_metrics: bool = False, access_log: bool = True, files: FileStore | None = None,
                      batch_max_in_flight: int = DEFAULT_BATCH_IN_FLIGHT,
                      responses_store: ResponseStore | None = None) -> FastAPI:
    """FastAPI app over ``router`` (routes in the module docstring; keywords as
    ``api_server.create_app``'s)."""
    from prometheus_client import CONTENT_TYPE_LATEST

    files = files if files is not None else FileStore()
    responses_store = responses_store if responses_store is not None else ResponseStore()

    @contextlib.asynccontextmanager
    async def lifespan(_app):  # the idle unloader runs while serving; every model unloaded at shutdown
        task = asyncio.create_task(router.run_idle_unloader())
        yield
        task.cancel()
        await background.close()
        await jobs.close()
        await router.close()
        files.close()

    app = FastAPI(title="Atlas VLM OpenAI-compatible server (several models)", lifespan=lifespan)
    created = int(time.time())
    install_error_handlers(app)
    install_middlewares(app, api_key, protect_docs_metrics, access_log, max_request_body_bytes,
                        {FILES_PATH: (files.max_file_bytes + UPLOAD_MARGIN_BYTES, "--max-file-bytes")})

    def _card(name: str) -> dict:
        loaded = router.slots[name].loaded
        if loaded is None:
            return {"id": name, "object": "model", "created": created, "owned_by": "atlas-vlm", "root": name,
                    "parent": None, "status": router.status(name)}
        ctx = loaded.ctx
        return {**model_card(name, created, ctx.max_model_len, ctx.model_info, ctx.is_vlm), "status": "loaded"}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(metrics_text(router), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_responses(401))
    async def models():
        return {"object": "list", "data": [_card(name) for name in router.names]}

    @app.get("/v1/models/{model_id:path}", responses=_responses(401, 404))
    async def model(model_id: str):
        return _card(router.slot(model_id).spec.name)

    @app.post("/models/load", responses=_responses(400, 401, 404, 500, 503))
    async def load(body: ModelAction):
        await router.load(body.model)
        return {"success": True, "model": body.model, "status": router.status(body.model)}

    @app.post("/models/unload", responses=_responses(400, 401, 404, 409))
    async def unload(body: ModelAction):
        was_loaded = await router.unload(body.model)
        return {"success": True, "model": body.model, "was_loaded": was_loaded, "status": router.status(body.model)}

    background, jobs = add_routed_routes(app, router, _responses, files=files, store=responses_store,
                                         batch_max_in_flight=batch_max_in_flight)
    add_web_routes(app)
    install_openapi(app)
    return app


def run_router_server(specs, config_for, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                      max_waiting_requests: int | None = None, media=None, log_level: str = "info",
                      max_request_body_bytes: int | None = None, max_prompts_per_request: int = 64,
                      protect_docs_metrics: bool = False, input_workers: int = 2, shutdown_timeout_s: float = 30.0,
                      access_log: bool = True, max_loaded_models: int = 1, model_load_timeout_s: float = 600.0,
                      idle_unload_s: float | None = None, files_dir: str | None = None,
                      max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, batch_max_in_flight: int = DEFAULT_BATCH_IN_FLIGHT,
                      responses_dir: str | None = None, max_stored_responses: int = 1024) -> int:
    """Serve the ``ModelSpec``s ``specs`` behind one endpoint until SIGTERM/SIGINT; each
    model's engine is built as ``api_server.run_server`` builds its one (``LLMEngine`` over
    ``config_for(spec)``, an ``AsyncLLM`` front, ``server_context``) when first needed.
    Other keywords as ``run_server``'s (files, batches and stored responses shared by every
    model), plus the router's (``ModelRouter``).

    Returns:
        0 after a signal.
    """
    import signal

    import uvicorn

    from atlas_vlm.engine import LLMEngine
    from atlas_vlm.engine.async_llm import AsyncLLM
    from atlas_vlm.entrypoints.openai.api_server import one_media_policy, server_context
    from atlas_vlm.entrypoints.openai.metrics import PrometheusStatLogger
    from atlas_vlm.entrypoints.openai.middleware import default_max_request_body_bytes
    from atlas_vlm.entrypoints.openai.model_router import LoadedModel

    def build(spec) -> LoadedModel:
        config, policy = one_media_policy(config_for(spec), media)
        engine = LLMEngine(config)
        stat_logger = PrometheusStatLogger()
        front = AsyncLLM(engine, max_waiting_requests=max_waiting_requests, stat_logger=stat_logger,
                         input_workers=input_workers,
                         on_dead=lambda e: logger.error("model %s: engine dead: %s", spec.name, e))
        stat_logger.attach(front)
        ctx = server_context(engine, front, config, [spec.name], policy, max_prompts_per_request)

        def close() -> None:
            front.shutdown()
            if not front.join(timeout=shutdown_timeout_s):
                logger.warning("model %s: engine step still running after %.0f s", spec.name, shutdown_timeout_s)

        return LoadedModel(ctx, close, stat_logger.registry)

    router = ModelRouter(specs, build, max_loaded=max_loaded_models, load_timeout_s=model_load_timeout_s,
                         idle_unload_s=idle_unload_s)
    if max_request_body_bytes is None and media is not None:
        max_request_body_bytes = default_max_request_body_bytes(media.max_image_bytes)
    app = create_router_app(router, api_key, max_request_body_bytes=max_request_body_bytes,
                            protect_docs_metrics=protect_docs_metrics, access_log=access_log,
                            files=FileStore(files_dir, max_file_bytes), batch_max_in_flight=batch_max_in_flight,
                            responses_store=ResponseStore(max_stored_responses, responses_dir))

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # first signal: stop admitting, end every stream now
            for loaded in router.loaded().values():
                loaded.ctx.engine.shutdown()
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=shutdown_timeout_s, access_log=False))
    for sig in (signal.SIGINT, signal.SIGTERM):  # exit 0 after a graceful stop (see run_server)
        signal.signal(sig, lambda *_: None)
    logger.info("serving %d models on http://%s:%d: %s (at most %d loaded)", len(specs), host, port,
                ", ".join(s.name for s in specs), max_loaded_models)
    server.run()
    return 0
