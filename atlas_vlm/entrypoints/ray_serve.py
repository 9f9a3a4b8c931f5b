"""N engine replicas behind the OpenAI routes on Ray Serve (``atlas-vlm serve --replicas N``).

Layout: one Ray Serve application of N+1 deployments. ``engine-0`` .. ``engine-{N-1}`` are
``EngineReplica`` deployments of one replica each (each owns an ``LLMEngine`` + ``AsyncLLM``
on its own device: ``num_gpus`` per replica on a cluster, a share of the CPU cores here);
``ingress`` is ``OpenAIIngress``, which serves the existing FastAPI app of
``api_server.create_app`` with a ``RemoteEngine`` in place of the ``AsyncLLM``, so the
route logic is the single server's. One deployment per replica (not one deployment with
``num_replicas=N``) lets the ingress pick the replica itself (``ReplicaRouter``: cache-aware
or least-loaded); Ray Serve's own router would pick among replicas of one deployment by
power-of-two choices, blind to our caches. Ray Serve's controller restarts a replica whose
actor died or whose ``check_health`` raises. ``app_builder`` is the entry of
``serve run`` / ``serve deploy`` (see ``deploy/ray_serve.yaml``).
"""

from __future__ import annotations

import dataclasses
import os

from ray import serve
from ray.serve.handle import DeploymentHandle

from atlas_vlm.entrypoints.openai.model_specs import SEVERAL_MODELS_WITH_REPLICAS


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=2, health_check_timeout_s=30)
class EngineReplica:
    """One engine (``LLMEngine`` + ``AsyncLLM``) and its Prometheus registry.

    Args:
        engine_kwargs: flat ``EngineConfig`` keywords (``EngineConfig.flat_kwargs()``).
        max_waiting_requests: as ``--max-waiting-requests`` (per replica).
        num_threads: torch CPU threads (the replica's CPU share; 0: torch's default).
    """

    def __init__(self, engine_kwargs: dict, max_waiting_requests: int | None = None, num_threads: int = 0):
        import torch

        from atlas_vlm.config import EngineConfig
        from atlas_vlm.engine import LLMEngine
        from atlas_vlm.engine.async_llm import AsyncLLM
        from atlas_vlm.entrypoints.openai.metrics import PrometheusStatLogger

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.stat_logger = PrometheusStatLogger()
        self.front = AsyncLLM(LLMEngine(EngineConfig(**engine_kwargs)), max_waiting_requests=max_waiting_requests,
                              stat_logger=self.stat_logger)
        self.stat_logger.attach(self.front)

    async def generate(self, prompt, sampling_params, request_id: str):
        """Stream ``(kind, item, num_cached_tokens)``: first ``("ok", None, 0)`` once the
        request is queued (or ``("error", exception, 0)`` and nothing else), then
        ``("out", RequestOutput, cached)`` per engine output. Cancelling aborts the request."""
        try:
            stream = await self.front.add_request(prompt, sampling_params, request_id)
        except Exception as e:  # noqa: BLE001 - handed to the ingress, which maps it to HTTP
            yield "error", e, 0
            return
        yield "ok", None, 0
        try:
            async for out in stream:
                yield "out", out, stream.num_cached_tokens
        finally:
            await stream.aclose()

    def ping(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        """Ray Serve's health hook: raising makes the controller replace this replica."""
        if getattr(self.front, "dead", False):  # repeated step faults: AsyncLLM gave up on this engine
            raise RuntimeError(f"engine is dead: {self.front._dead}")
        if not self.front.alive:
            raise RuntimeError("engine thread is not running")

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.stat_logger.registry).decode()


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress()
class OpenAIIngress:
    """The OpenAI routes (``create_app``) over a ``RemoteEngine`` of the replica handles."""

    def __init__(self, settings: dict, *replicas: DeploymentHandle):
        from atlas_vlm.entrypoints.remote_engine import RemoteEngine
        from atlas_vlm.entrypoints.replica_router import ReplicaRouter

        self.settings = settings
        router = ReplicaRouter(len(replicas), settings.get("routing", "cache_aware"),
                               settings.get("imbalance_threshold", 4))
        self.engine = RemoteEngine(list(replicas), router, settings["model"])

    def set_routing(self, policy: str, imbalance_threshold: int | None = None) -> None:
        """Switch the routing policy at run time (deployment-handle call, not an HTTP route).

        Raises:
            ValueError: unknown ``policy``.
        """
        from atlas_vlm.entrypoints.replica_router import POLICIES

        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {POLICIES}")
        self.engine.router.policy = policy
        if imbalance_threshold is not None:
            self.engine.router.imbalance_threshold = imbalance_threshold

    def __serve_build_asgi_app__(self):
        from atlas_vlm.entrypoints.openai.api_server import create_app
        from atlas_vlm.entrypoints.openai.batch.files import DEFAULT_MAX_FILE_BYTES, FileStore
        from atlas_vlm.entrypoints.openai.batch.jobs import DEFAULT_BATCH_IN_FLIGHT
        from atlas_vlm.entrypoints.openai.media import MediaPolicy
        from atlas_vlm.entrypoints.openai.serving_common import ServerContext
        from atlas_vlm.tool_parsers import ToolParserManager

        s = self.settings
        from atlas_vlm.entrypoints.openai.api_server import default_max_request_body_bytes

        media = MediaPolicy(**s.get("media", {}))
        ctx = ServerContext(self.engine, s["served_model_names"], s["is_vlm"], media, s["max_model_len"],
                            max_prompts_per_request=s.get("max_prompts_per_request", 64), model_root=s["model"],
                            tool_parser=ToolParserManager.get_tool_parser(s["tool_call_parser"])
                            if s.get("tool_call_parser") else None)  # None: from the tokenizer's template
        body = s.get("max_request_body_bytes") or default_max_request_body_bytes(media.max_image_bytes)
        files = FileStore(s.get("files_dir"), s.get("max_file_bytes") or DEFAULT_MAX_FILE_BYTES)
        return create_app(ctx, None, s.get("api_key"), metrics_text=self.engine.metrics_text,
                          max_request_body_bytes=body, protect_docs_metrics=s.get("protect_docs_metrics", False),
                          files=files, batch_max_in_flight=s.get("batch_max_in_flight") or DEFAULT_BATCH_IN_FLIGHT)


def build_app(engine_kwargs: dict, num_replicas: int, *, served_model_names: list[str] | None = None,
              routing: str = "cache_aware", imbalance_threshold: int = 4, num_cpus_per_replica: float | None = None,
              num_gpus_per_replica: float = 0, max_waiting_requests: int | None = None, api_key: str | None = None,
              media: dict | None = None, server_limits: dict | None = None):
    """The Ray Serve application (not yet running): N ``EngineReplica`` + the ingress.

    Args:
        server_limits: the ingress's ``max_request_body_bytes``, ``max_prompts_per_request``,
            ``protect_docs_metrics``, ``files_dir``, ``max_file_bytes`` and
            ``batch_max_in_flight`` (as the plain server's flags).
        engine_kwargs: flat ``EngineConfig`` keywords (``model`` required).
        media: the server's ``MediaPolicy`` fields; its fetch fields (``allow_http_images``,
            ``http_timeout_s``, ``max_image_bytes``, ...) become the engine's
            ``multimodal_config.media`` too (one policy), ``allowed_local_media_path`` stays
            the ingress's.
        num_cpus_per_replica: Ray CPUs per replica (default: this machine's cores / N, >= 1).
        num_gpus_per_replica: GPUs per replica (1 on a GPU cluster; 0 here).

    Raises:
        ValueError: ``num_replicas < 1``, unknown ``routing``, a bad ``EngineConfig`` field.
    """
    from transformers import AutoConfig

    from atlas_vlm.config import EngineConfig
    from atlas_vlm.entrypoints.openai.served_name import default_served_model_name
    from atlas_vlm.entrypoints.replica_router import ReplicaRouter
    from atlas_vlm.hub import resolve_model_path

    ReplicaRouter(num_replicas, routing, imbalance_threshold)  # validates the three
    config = EngineConfig(**{"limit_request_pixels": True, **engine_kwargs})  # served: requests cannot raise bounds
    media = dict(media or {})
    local = media.pop("allowed_local_media_path", None)
    if media:  # fetch fields given here are the engine's policy too: one policy for engine and server
        mm = config.multimodal_config
        config = dataclasses.replace(config, multimodal_config=dataclasses.replace(
            mm, media=dataclasses.replace(mm.media, **media)))
    media = {**dataclasses.asdict(config.multimodal_config.media), "allowed_local_media_path": local}
    cpus = num_cpus_per_replica if num_cpus_per_replica is not None else max(1, (os.cpu_count() or 1) // num_replicas)
    model_config = config.model_config
    model = str(model_config.model)
    path = resolve_model_path(model, model_config.revision, config_only=True)  # a folder, a .gguf or a hub snapshot
    is_vlm = path.is_dir() and hasattr(AutoConfig.from_pretrained(path), "vision_config")
    replicas = [EngineReplica.options(name=f"engine-{i}", ray_actor_options={"num_cpus": cpus,
                                                                             "num_gpus": num_gpus_per_replica})
                .bind(config.flat_kwargs(), max_waiting_requests, int(cpus)) for i in range(num_replicas)]
    settings = dict(model=model, served_model_names=served_model_names or [default_served_model_name(model)],
                    is_vlm=is_vlm,
                    max_model_len=model_config.max_model_len or 4096, routing=routing,
                    imbalance_threshold=imbalance_threshold, api_key=api_key, media=media,
                    tool_call_parser=model_config.tool_call_parser,
                    **(server_limits or {}))
    return OpenAIIngress.options(name="ingress", ray_actor_options={"num_cpus": 0}).bind(settings, *replicas)


def app_builder(args: dict):
    """``serve run atlas_vlm.entrypoints.ray_serve:app_builder key=value ...`` and the
    ``import_path`` of ``deploy/ray_serve.yaml``: ``args`` holds ``engine`` (``EngineConfig``
    fields) and the keyword arguments of :func:`build_app` (``num_replicas`` default 2); a
    ``models`` list is a ValueError saying why (``SEVERAL_MODELS_WITH_REPLICAS``)."""
    args = dict(args)
    if "models" in args:  # several models are the router's (one process), never replicas of one
        raise ValueError(f"`models` in a Ray Serve application: {SEVERAL_MODELS_WITH_REPLICAS}")
    engine = dict(args.pop("engine", {}))
    if "model" in args:
        engine["model"] = args.pop("model")
    if "model" not in engine:
        from atlas_vlm.default_models import default_text_model
        engine["model"] = default_text_model()
    return build_app(engine, int(args.pop("num_replicas", 2)), **args)


def run_ray_server(engine_config, args) -> int:
    """``atlas-vlm serve MODEL --replicas N``: start (or join, ``--ray-address``) Ray, run the
    application on ``--host``/``--port`` until SIGTERM/SIGINT, then shut Serve down; returns 0.

    Raises:
        ValueError: a bad flag (from :func:`build_app`).
    """
    import signal
    import threading

    import ray

    from atlas_vlm.entrypoints.openai.served_name import default_served_model_name

    # the http(s) media flags are in engine_config already (its multimodal_config.media, one policy)
    media = dict(allowed_local_media_path=args.allowed_local_media_path)
    app = build_app(engine_config.flat_kwargs(), args.replicas,
                    served_model_names=args.served_model_name or [default_served_model_name(args.model)],
                    routing=args.routing, imbalance_threshold=args.imbalance_threshold,
                    num_cpus_per_replica=args.num_cpus_per_replica, num_gpus_per_replica=args.num_gpus_per_replica,
                    max_waiting_requests=args.max_waiting_requests, api_key=args.api_key, media=media,
                    server_limits=dict(max_request_body_bytes=getattr(args, "max_request_body_bytes", None),
                                       max_prompts_per_request=getattr(args, "max_prompts_per_request", 64),
                                       protect_docs_metrics=getattr(args, "protect_docs_metrics", False),
                                       files_dir=getattr(args, "files_dir", None),
                                       max_file_bytes=getattr(args, "max_file_bytes", None),
                                       batch_max_in_flight=getattr(args, "max_batch_concurrency", None)))
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # never join a cluster found by chance: the one named (flag or RAY_ADDRESS), else a new local one
    ray.init(address=args.ray_address or os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="atlas", route_prefix="/")
        print(f"serving {args.replicas} replicas of {engine_config.model_config.model} on http://{args.host}:{args.port} "
              f"(routing: {args.routing})", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
