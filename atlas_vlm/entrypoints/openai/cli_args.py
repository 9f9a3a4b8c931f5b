"""``atlas-vlm serve [MODEL]``: the flags of the OpenAI-compatible server, generated from the
settings dataclasses (``atlas_vlm.config.cli``): one per ``ServerConfig`` field and one per
``EngineConfig`` sub-config field (the http(s) media flags are its ``multimodal_config.media``,
the one ``MediaFetchPolicy`` the server's ``MediaPolicy`` wraps); read back as those two
objects for ``run_server``. Hand-written: MODEL, the several-models and the replica flags
(flag names follow ``vllm serve``)."""

from __future__ import annotations

import logging


def add_parser(sub) -> None:
    """Register ``atlas-vlm serve`` (flag names follow ``vllm serve``)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, metrics)",
                       description="Serve MODEL over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    add_server_args(p)
    add_engine_args(p)
    m = p.add_argument_group("several models (one endpoint; a request's model picks one; docs/server.md)")
    m.add_argument("--model", dest="models", action="append", default=None, metavar="[NAME=]PATH",
                   help="a model to serve (repeatable; NAME= sets its served name); two or more (or "
                        "--models-dir) load each on its first request")
    m.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model in DIR: each .gguf (with mmproj-<stem>.gguf), GGUF pair folder or HF "
                        "model folder, named by file stem or folder name, lower-cased")
    m.add_argument("--max-loaded-models", type=int, default=1,
                   help="models resident at once, the least recently used idle one unloaded first (default 1)")
    m.add_argument("--model-load-timeout-s", type=float, default=600.0,
                   help="seconds a request waits for its model to load before a 503 (default 600)")
    m.add_argument("--idle-unload-s", type=float, default=None,
                   help="unload a model idle this many seconds (default: never)")
    r = p.add_argument_group("replicas (Ray Serve; needs the ray extra)")
    r.add_argument("--replicas", type=int, default=1,
                   help="engine replicas; N > 1 serves them on Ray Serve behind one endpoint (default 1: no Ray)")
    r.add_argument("--routing", default="cache_aware", choices=["cache_aware", "least_loaded"],
                   help="replica choice: prefix/image-cache affinity, or fewest requests in flight")
    r.add_argument("--imbalance-threshold", type=int, default=4,
                   help="cache_aware: leave the cached replica when it has more than this many requests in "
                        "flight above the least-loaded one (default 4)")
    r.add_argument("--num-cpus-per-replica", type=float, default=None,
                   help="Ray CPUs (and torch threads) per replica (default: cores / replicas)")
    r.add_argument("--num-gpus-per-replica", type=float, default=0,
                   help="Ray GPUs per replica (1 on a GPU cluster; default 0)")
    r.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray started here)")
    p.set_defaults(func=run_serve)


def add_engine_args(p) -> None:
    """The engine's flags, one per ``EngineConfig`` sub-config field (``EngineConfig.add_cli_args``:
    name, type, default, choices and help from the field), shared by ``atlas-vlm serve`` and
    ``atlas-vlm run-batch``; read back by ``engine_config_from_args``."""
    from atlas_vlm.config import EngineConfig

    EngineConfig.add_cli_args(p)


def add_server_args(p) -> None:
    """The server's own flags, one per ``ServerConfig`` field; read back by ``server_config_from_args``."""
    from atlas_vlm.config.cli import add_flags
    from atlas_vlm.config.server import ServerConfig

    add_flags(p, ServerConfig)


def engine_config_from_args(args):
    """The ``EngineConfig`` of the parsed engine flags (``add_engine_args``; those the parser
    lacks keep their defaults), the model ``args.model`` (None: the embedded default), and
    ``limit_request_pixels`` on (a request may lower the server's image bounds, never raise them).

    Raises:
        ValueError: a flag out of range (named by its ``EngineConfig`` keyword or its flag).
    """
    from atlas_vlm.config import EngineConfig
    from atlas_vlm.default_models import default_text_model

    return EngineConfig.from_cli_args(args, model=args.model or default_text_model(), limit_request_pixels=True)


def server_config_from_args(args):
    """The ``ServerConfig`` of the parsed server flags (``add_server_args``).

    Raises:
        ValueError: a flag out of range (the message names it).
    """
    from atlas_vlm.config.cli import flag_values
    from atlas_vlm.config.server import ServerConfig

    return ServerConfig(**flag_values(args, ServerConfig))


def run_serve(args) -> int:
    from atlas_vlm.entrypoints.openai.api_server import run_server
    from atlas_vlm.entrypoints.openai.served_name import default_served_model_name

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    models = ([args.model] if args.model else []) + (args.models or [])
    if len(models) > 1 or args.models_dir:
        return _run_router(args, models)
    if models:  # one model (positional or --model [NAME=]PATH): the single-model server, as before
        from atlas_vlm.entrypoints.openai.model_specs import model_specs

        spec = model_specs(models, None)[0]
        args.model = spec.model
        if args.served_model_name is None and spec.model != models[0]:
            args.served_model_name = [spec.name]
    config = engine_config_from_args(args)
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        from atlas_vlm.entrypoints.ray_serve import run_ray_server
        return run_ray_server(config, args)
    if args.served_model_name is None:
        args.served_model_name = [default_served_model_name(args.model)]
    return run_server(config, server_config_from_args(args))


def _run_router(args, models: list[str]) -> int:
    """``atlas-vlm serve`` with several models (``router_app.run_router_server``)."""
    import argparse

    from atlas_vlm.entrypoints.openai.media import MediaPolicy
    from atlas_vlm.entrypoints.openai.model_specs import model_specs, refuse_replicas
    from atlas_vlm.entrypoints.openai.router_app import run_router_server

    specs = model_specs(models, args.models_dir)
    if not specs:
        raise ValueError(f"no model found in --models-dir {args.models_dir!r}")
    refuse_replicas(len(specs), args.replicas)  # Ray Serve replicas hold one model each (it says why)
    for flag in ("served_model_name",):
        if getattr(args, flag) not in (None, 1):
            raise ValueError(f"--{flag.replace('_', '-')} serves one model; not with several models")
    if args.idle_unload_s is not None and args.idle_unload_s <= 0:
        raise ValueError(f"--idle-unload-s must be > 0 seconds, got {args.idle_unload_s}")

    def config_for(spec):
        return engine_config_from_args(argparse.Namespace(**{**vars(args), "model": spec.model,
                                                              "mmproj": spec.mmproj or args.mmproj}))

    media = MediaPolicy.over(config_for(specs[0]).multimodal_config.media,
                             allowed_local_media_path=args.allowed_local_media_path)
    return run_router_server(specs, config_for, host=args.host, port=args.port, api_key=args.api_key,
                             max_waiting_requests=args.max_waiting_requests, media=media, log_level=args.log_level,
                             max_request_body_bytes=args.max_request_body_bytes,
                             max_prompts_per_request=args.max_prompts_per_request,
                             protect_docs_metrics=args.protect_docs_metrics, input_workers=args.input_workers,
                             shutdown_timeout_s=args.shutdown_timeout, access_log=args.access_log,
                             max_loaded_models=args.max_loaded_models,
                             model_load_timeout_s=args.model_load_timeout_s, idle_unload_s=args.idle_unload_s,
                             files_dir=args.files_dir, max_file_bytes=args.max_file_bytes,
                             batch_max_in_flight=args.max_batch_concurrency, responses_dir=args.responses_dir,
                             max_stored_responses=args.max_stored_responses)
