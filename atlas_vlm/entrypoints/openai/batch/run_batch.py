"""``atlas-vlm run-batch IN.jsonl OUT.jsonl``: OpenAI's batch file format run offline on a
local engine (as ``vllm run-batch``), each line through the server's own serving functions.

Resumable: lines whose ``custom_id`` already has a record in OUT (or ERR) are skipped, so
after a crash or Ctrl-C the same command continues where it stopped (a half-written last
record is redone). Failed lines go to ``--error-file`` (default: OUT too); exit code 0 even
when some lines failed (their records say why), 1 on a bad argument or a dead engine, 130
when interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from atlas_vlm.entrypoints.openai.batch.results import ResultFiles
from atlas_vlm.entrypoints.openai.batch.runner import DEFAULT_MAX_IN_FLIGHT, count_lines, read_lines, run_lines
from atlas_vlm.entrypoints.openai.served_name import default_served_model_name


def add_parser(sub) -> None:
    """Register ``atlas-vlm run-batch`` (engine flags as ``atlas-vlm serve``'s)."""
    from atlas_vlm.entrypoints.openai.cli_args import add_engine_args

    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline",
                       description="Run each line of IN (OpenAI batch format: custom_id, method, url, body; "
                                   "url /v1/chat/completions, /v1/completions or /v1/embeddings) and append "
                                   "one result record per line to OUT. Rerunning continues an interrupted run.")
    p.add_argument("input", metavar="IN", help="input JSONL file, one request per line")
    p.add_argument("output", metavar="OUT", help="output JSONL file (appended; lines already in it are skipped)")
    p.add_argument("--error-file", default=None, metavar="ERR",
                   help="write failed lines here instead of OUT (also read on a rerun)")
    p.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the lines' body.model may use; default: the --model path as given")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                   help=f"lines running at once (default {DEFAULT_MAX_IN_FLIGHT})")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="allow image_url / video_url file:// URLs and paths under DIR (default: no local files)")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="/v1/completions and /v1/embeddings lines: prompts in one body at most (default 64)")
    add_engine_args(p)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_batch)


def run_batch(args) -> int:
    """The subcommand: check the paths, build the engine, run, print a summary to stderr.

    Raises:
        ValueError: a bad flag value, IN and OUT/ERR the same file, OUT not a result file.
        OSError: IN unreadable, OUT/ERR unwritable (``atlas-vlm`` prints either as an error).
    """
    from atlas_vlm.engine import LLMEngine
    from atlas_vlm.engine.request_stream import EngineDeadError
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    for name in ("max_concurrency", "max_prompts_per_request"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    src = Path(args.input)
    if not src.is_file():
        raise OSError(f"input file {src} does not exist or is not a file")
    for other in (args.output, args.error_file):
        if other is not None and Path(other).exists() and Path(other).resolve() == src.resolve():
            raise ValueError(f"{other} is the input file: write results to another file")
    total = count_lines(src)
    results = ResultFiles(args.output, args.error_file)
    try:
        engine_config = engine_config_from_args(args)
        engine = LLMEngine(engine_config)
        names = args.served_model_name or [default_served_model_name(args.model)]
        asyncio.run(_run(engine, engine_config, args, names, results, total))
    except EngineDeadError as e:
        print(f"atlas-vlm run-batch: error: the engine died ({e}); rerun the same command to continue",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("atlas-vlm run-batch: interrupted; rerun the same command to continue", file=sys.stderr)
        return 130
    finally:
        results.close()
    err = f", errors in {args.error_file}" if args.error_file else ""
    print(f"atlas-vlm run-batch: {results.completed} completed, {results.failed} failed, of {total} lines; "
          f"results in {args.output}{err}", file=sys.stderr)
    return 0


async def _run(engine, engine_config, args, names: list[str], results: ResultFiles, total: int) -> None:
    from tqdm import tqdm

    from atlas_vlm.engine.async_llm import AsyncLLM
    from atlas_vlm.entrypoints.openai.api_server import server_context
    from atlas_vlm.entrypoints.openai.media import MediaPolicy

    front = AsyncLLM(engine)
    ctx = server_context(engine, front, engine_config, names, MediaPolicy.over(engine_config.multimodal_config.media,
                                                                 allowed_local_media_path=args.allowed_local_media_path),
                         args.max_prompts_per_request)
    bar = tqdm(total=total, unit="req", desc="run-batch", disable=None)
    try:
        await run_lines(ctx, read_lines(args.input), results, max_in_flight=args.max_concurrency,
                        on_record=lambda ok, record: bar.update(1), on_skip=lambda: bar.update(1))
    finally:
        bar.close()
        front.shutdown()
        front.join(timeout=30)
