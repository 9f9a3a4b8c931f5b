"""``atlas-vlm serve [MODEL]``: the flags of the OpenAI-compatible server and how they become
an ``EngineConfig`` (flat keywords routed to its sub-configs; the http(s) media flags
become its ``multimodal_config.media``, the one ``MediaFetchPolicy``) and the server's
``MediaPolicy`` over that same policy (flag names follow ``vllm serve``)."""

from __future__ import annotations

import logging

from atlas_vlm.entrypoints.cli import bytes_arg


def tool_parser_names() -> list[str]:
    """The ``--tool-call-parser`` names (``atlas_vlm.tool_parsers`` registry)."""
    from atlas_vlm.tool_parsers import ToolParserManager

    return ToolParserManager.names()


def add_parser(sub) -> None:
    """Register ``atlas-vlm serve`` (flag names follow ``vllm serve``)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, metrics)",
                       description="Serve MODEL over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--mmproj", default=None,
                   help="llama.cpp mmproj GGUF (vision tower) of the VLM whose language model GGUF is MODEL")
    p.add_argument("--hf-file", default=None, metavar="NAME.gguf",
                   help="the .gguf of the Hub GGUF repo MODEL to load (llama.cpp's --hf-file); default: MODEL's "
                        ":QUANT tag (ORG/NAME-GGUF:Q8_0), else Q4_K_M, else the repo's first .gguf")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use, the first one in responses; default: a file's stem or a folder's "
                        "name, lower-cased (a Hub id as given); the MODEL path is also accepted in requests")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (else 401)")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 while this many requests wait (default: no limit)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="allow image_url / video_url file:// URLs and paths under DIR (default: no local files)")
    p.add_argument("--allow-http-images", action="store_true",
                   help="fetch http(s) image and video URLs (default: refused)")
    p.add_argument("--image-fetch-timeout", type=float, default=10.0,
                   help="connect/read timeout of one http(s) image download, seconds (default 10)")
    p.add_argument("--max-image-bytes", type=bytes_arg(), default=20 * 2**20,
                   help="largest encoded image accepted from any source (default 20MiB)")
    p.add_argument("--max-video-bytes", type=bytes_arg(), default=64 * 2**20,
                   help="largest encoded video_url video accepted from a file or URL (default 64MiB; a data: URI "
                        "is also bounded by --max-request-body-bytes)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="with --allow-http-images: fetch images only from these hosts (exact names or IPs); a "
                        "host named here may resolve to a private address (default: any host with a public "
                        "address; loopback, private, link-local, multicast and unspecified are always refused)")
    p.add_argument("--max-request-body-bytes", type=bytes_arg(), default=None,
                   help="413 for a larger request body (default: one --max-image-bytes image as base64 + 1MiB)")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="/v1/completions: prompts in one call at most (default 64)")
    p.add_argument("--protect-docs-metrics", action="store_true",
                   help="with --api-key: also require the key on /docs, /redoc, /openapi.json and /metrics")
    p.add_argument("--input-workers", type=int, default=2,
                   help="threads that tokenize and preprocess images off the engine thread (default 2)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to wait on SIGTERM for open connections and the engine's current step (default 30)")
    b = p.add_argument_group("files and batches (/v1/files, /v1/batches)")
    b.add_argument("--files-dir", default=None, metavar="DIR",
                   help="keep uploaded files and batch results in DIR, listed again after a restart (default: a "
                        "temporary directory removed when the server stops)")
    b.add_argument("--max-file-bytes", type=bytes_arg(), default=200 * 10**6,
                   help="largest file accepted by POST /v1/files (default 200MB; 413 above)")
    b.add_argument("--responses-dir", default=None, metavar="DIR",
                   help="keep /v1/responses' stored responses as files in DIR, found again after a restart "
                        "(default: in memory)")
    b.add_argument("--max-stored-responses", type=int, default=1024,
                   help="stored responses kept at most, the oldest dropped first (default 1024)")
    b.add_argument("--max-batch-concurrency", type=int, default=16,
                   help="lines of one batch running at once, alongside live requests (default 16)")
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
    g = p.add_argument_group("logs")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log lines written (default info: startup, access and engine lines)")
    g.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no access line per request (route, status, tokens, time to first token, total time, id)")
    g.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                   help="seconds between the engine lines (tok/s, running / waiting, KV usage, prefix-cache hit "
                        "rate) while busy (default 10; 0: none)")
    p.set_defaults(func=run_serve)


def add_engine_args(p) -> None:
    """The engine's flags (model length, dtype, device, KV cache, scheduler, image bounds,
    seed, parsers), shared by ``atlas-vlm serve`` and ``atlas-vlm run-batch``; read back by
    ``engine_config_from_args``."""
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per request (prompt + output)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf", "gguf_int", "dequantize", "awq", "gptq"],
                   help="weight-only quantization: int8 / int4 at load, gguf as stored (a .gguf's default), "
                        "gguf_int (a .gguf converted to int8 / int4 tiles), dequantize (its dense copy), awq / gptq "
                        "(read from the checkpoint's quantization_config when not given)")
    p.add_argument("--kv-cache-memory", type=bytes_arg(), default=None,
                   help="CPU: bytes of KV cache (e.g. 512MiB; default 1GiB)")
    p.add_argument("--num-kvcache-blocks", type=int, default=-1, help="KV blocks (-1: from memory)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                   help="K/V storage: auto (the model dtype), int8 or fp8_e4m3 (8 bits + one scale per token and KV head: ~1.9x the tokens in the same memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens computed per step")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--max-state-snapshots", type=int, default=16,
                   help="hybrid models (Qwen3.5) with prefix caching: recurrent-state snapshots kept (one is "
                        "StateSpec.bytes_per_seq, ~20 MB for Qwen3.5-0.8B; 0: prefix caching off; docs/kv-cache.md)")
    p.add_argument("--hybrid-snapshot-interval", type=int, default=256,
                   help="hybrid models: tokens between state snapshots (a multiple of --block-size)")
    add_kv_cache_dir_args(p)
    p.add_argument("--max-pixels", type=int, default=None, help="per-image pixel bound after resize")
    p.add_argument("--min-pixels", type=int, default=None, help="per-image lower pixel bound after resize")
    p.add_argument("--seed", type=int, default=0, help="default sampling seed")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split <think>..</think> into reasoning_content (Qwen3 / Qwen3-VL); grammars apply after it")
    p.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="tool-call format: hermes (<tool_call> JSON), qwen3_coder (XML), llama3_json, mistral "
                        "(default: detected from the chat template)")
    p.add_argument("--speculative", default=None, choices=["ngram", "mtp"],
                   help="speculative decoding: ngram (prompt-lookup drafts) or mtp (a Qwen3.5 checkpoint's "
                        "multi-token-prediction head). Distribution-exact always; token-for-token equal to "
                        "speculation off only in fp32 or with --deterministic (in bf16 a near-tie can part them: "
                        "verification rows are other GEMM shapes); docs/speculative.md")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="drafts per decode step with --speculative (default 4)")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=2,
                   help="no drafts while more requests than this run (default 2: measured, drafts lose in batches)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: a request's tokens and logprobs do not depend on the batch "
                        "(CPU, dense weights; slower; docs/deterministic.md)")


#: ``atlas-vlm serve`` media flags (argparse dest) -> flat ``EngineConfig`` keyword (the fetch policy's).
MEDIA_FLAGS = {"allow_http_images": "allow_http_images", "image_fetch_timeout": "http_image_timeout_s",
               "max_image_bytes": "http_image_max_bytes", "max_video_bytes": "max_video_bytes",
               "allowed_media_domains": "allowed_media_domains"}


def engine_config_from_args(args):
    """The ``EngineConfig`` of parsed engine flags (``add_engine_args``) and, where the parser
    has them (``serve``), the media fetch flags (``MEDIA_FLAGS``).

    Raises:
        ValueError: a flag out of range (named by its ``EngineConfig`` keyword).
    """
    from atlas_vlm.config import EngineConfig, kv_cache_dir_kwargs
    from atlas_vlm.default_models import default_text_model

    kwargs = dict(model=args.model or default_text_model(), mmproj=getattr(args, "mmproj", None),
                  hf_file=getattr(args, "hf_file", None), dtype=args.dtype, device=args.device,
                  quantization=args.quantization, kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                  max_model_len=args.max_model_len, num_kvcache_blocks=args.num_kvcache_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization, kvcache_block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                  reasoning_parser=args.reasoning_parser, tool_call_parser=getattr(args, "tool_call_parser", None),
                  speculative=getattr(args, "speculative", None),
                  num_speculative_tokens=getattr(args, "num_speculative_tokens", None),
                  speculative_disable_by_batch_size=getattr(args, "speculative_disable_by_batch_size", 2),
                  deterministic=getattr(args, "deterministic", False),
                  max_state_snapshots=getattr(args, "max_state_snapshots", 16),
                  hybrid_snapshot_interval=getattr(args, "hybrid_snapshot_interval", 256),
                  limit_request_pixels=True)  # a request may lower the server's image bounds, never raise them
    for name in ("kv_cache_memory", "max_pixels", "min_pixels"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    kwargs.update(kv_cache_dir_kwargs(getattr(args, "kv_cache_dir", None), getattr(args, "kv_cache_dir_max_gb", None)))
    kwargs.update({name: getattr(args, dest) for dest, name in MEDIA_FLAGS.items() if hasattr(args, dest)})
    return EngineConfig(**kwargs)


def add_kv_cache_dir_args(p) -> None:
    """``--kv-cache-dir`` / ``--kv-cache-dir-max-gb`` (the disk KV tier), for serve and scripts/generate.py."""
    p.add_argument("--kv-cache-dir", default=None, metavar="PATH",
                   help="disk tier below the prefix cache: full KV blocks are kept in PATH and found again, "
                        "also after a restart (needs prefix caching)")
    p.add_argument("--kv-cache-dir-max-gb", type=float, default=None, metavar="X",
                   help="size cap of --kv-cache-dir in GiB, least recently used blocks out first (default 10)")


def run_serve(args) -> int:
    from atlas_vlm.entrypoints.openai.api_server import run_server
    from atlas_vlm.entrypoints.openai.media import MediaPolicy
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
    for name in ("max_prompts_per_request", "input_workers", "max_file_bytes", "max_batch_concurrency",
                 "max_stored_responses"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.log_stats_interval < 0:
        raise ValueError(f"--log-stats-interval must be >= 0 seconds (0: no engine lines), "
                         f"got {args.log_stats_interval}")
    if args.shutdown_timeout <= 0:
        raise ValueError(f"--shutdown-timeout must be > 0 seconds, got {args.shutdown_timeout}")
    media = MediaPolicy.over(config.multimodal_config.media, allowed_local_media_path=args.allowed_local_media_path)
    return run_server(config, host=args.host, port=args.port,
                      served_model_names=args.served_model_name or [default_served_model_name(args.model)],
                      api_key=args.api_key, max_waiting_requests=args.max_waiting_requests, media=media,
                      log_level=args.log_level, max_request_body_bytes=args.max_request_body_bytes,
                      max_prompts_per_request=args.max_prompts_per_request,
                      protect_docs_metrics=args.protect_docs_metrics, input_workers=args.input_workers,
                      shutdown_timeout_s=args.shutdown_timeout, files_dir=args.files_dir,
                      max_file_bytes=args.max_file_bytes, batch_max_in_flight=args.max_batch_concurrency,
                      responses_dir=args.responses_dir, max_stored_responses=args.max_stored_responses,
                      access_log=args.access_log, log_stats_interval_s=args.log_stats_interval or None)


def _run_router(args, models: list[str]) -> int:
    """``atlas-vlm serve`` with several models (``router_app.run_router_server``)."""
    import argparse

    from atlas_vlm.entrypoints.openai.media import MediaPolicy
    from atlas_vlm.entrypoints.openai.model_specs import model_specs
    from atlas_vlm.entrypoints.openai.router_app import run_router_server

    specs = model_specs(models, args.models_dir)
    if not specs:
        raise ValueError(f"no model found in --models-dir {args.models_dir!r}")
    for flag in ("replicas", "served_model_name"):
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
                             model_load_timeout_s=args.model_load_timeout_s, idle_unload_s=args.idle_unload_s)
