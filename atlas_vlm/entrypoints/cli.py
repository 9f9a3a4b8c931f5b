"""``atlas-vlm``: the command line, one argparse subcommand per task.

Each subcommand module exposes ``add_parser(subparsers)``, which registers its arguments and
sets ``func`` (``args -> exit code``); ``main`` parses and dispatches. Adding a subcommand is
one line in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = (
    "atlas_vlm.entrypoints.plan",  # atlas-vlm plan
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlas-vlm", description="Atlas VLM: paged-KV inference for (V)LMs")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; a bad input prints ``error: ...`` and returns 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"atlas-vlm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
