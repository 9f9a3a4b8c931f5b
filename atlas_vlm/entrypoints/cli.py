"""``atlas-vlm``: the command line, one argparse subcommand per task (``serve``, ``chat``, ``plan``, ``run-batch``).

Each subcommand module exposes ``add_parser(subparsers)``, which registers its arguments and
sets ``func`` (``args -> exit code``); ``main`` parses and dispatches. Adding a subcommand is
one line in ``SUBCOMMANDS``. Also ``python -m atlas_vlm.serve`` (= ``atlas-vlm serve``).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

SUBCOMMANDS = (
    "atlas_vlm.entrypoints.openai.cli_args",  # atlas-vlm serve
    "atlas_vlm.entrypoints.chat_cli",  # atlas-vlm chat
    "atlas_vlm.entrypoints.plan",  # atlas-vlm plan
    "atlas_vlm.entrypoints.openai.batch.run_batch",  # atlas-vlm run-batch
)

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "kb": 10**3, "m": MiB, "mib": MiB, "mb": 10**6,
          "g": GiB, "gib": GiB, "gb": 10**9, "t": TiB, "tib": TiB, "tb": 10**12}


def parse_bytes(text: str, *, bare_unit: int = 1) -> int:
    """A byte size: ``"512MiB"``, ``"2G"`` (K/M/G/T and KiB.. are powers of 1024), ``"24GB"``
    (KB/MB/GB/TB are powers of 1000), or a bare number times ``bare_unit`` (bytes by default).

    Raises:
        ValueError: not a number with one of those units.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 1073741824, 512MiB, 24GiB, 24GB)")
    unit = _UNITS[m.group(2).lower()] if m.group(2) else bare_unit
    return int(float(m.group(1)) * unit)


def bytes_arg(bare_unit: int = 1):
    """An argparse ``type=`` for :func:`parse_bytes` (its error shown as argparse's own)."""
    def parse(text: str) -> int:
        try:
            return parse_bytes(text, bare_unit=bare_unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


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
