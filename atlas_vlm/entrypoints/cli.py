"""``atlas-vlm``: the command line, one argparse subcommand per task (``serve``, ``chat``, ``plan``, ``run-batch``).

Each subcommand module exposes ``add_parser(subparsers)``, which registers its arguments and
sets ``func`` (``args -> exit code``); ``main`` parses and dispatches. Adding a subcommand is
one line in ``SUBCOMMANDS``. Also ``python -m atlas_vlm.serve`` (= ``atlas-vlm serve``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = (
    "atlas_vlm.entrypoints.openai.cli_args",  # atlas-vlm serve
    "atlas_vlm.entrypoints.chat_cli",  # atlas-vlm chat
    "atlas_vlm.entrypoints.plan",  # atlas-vlm plan
    "atlas_vlm.entrypoints.openai.batch.run_batch",  # atlas-vlm run-batch
)

from atlas_vlm.config.cli import bytes_arg, parse_bytes  # noqa: F401  (the byte-size flags' parser; re-exported)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlas-vlm", description="Atlas VLM: paged-KV inference for (V)LMs")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; a bad input (bad model path, bad config,
    port in use) prints ``atlas-vlm CMD: error: ...`` and returns 1."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"atlas-vlm {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
