"""The LoRA flags of ``atlas-vlm serve`` (vLLM's names): ``--enable-lora``, ``--max-loras``,
``--max-lora-rank`` (one per ``config.lora.LoRAConfig`` field, same names, defaults and help:
tests/lora/test_lora_server.py checks they match) and ``--lora-modules NAME=PATH ...``.

Scope: argparse only, without importing torch (``atlas-vlm --help`` stays light): the
fields are listed here as ``LORA_FLAGS`` rather than read from ``LoRAConfig``, whose package
imports the engine's config (torch).
"""

from __future__ import annotations

#: LoRAConfig field -> (default, help); the flag is --FIELD with dashes
LORA_FLAGS = {
    "enable_lora": (False, "serve LoRA adapters (PEFT format; per request by model=NAME, --lora-modules, "
                           "/v1/load_lora_adapter)"),
    "max_loras": (4, "LoRA adapters resident at once (fixed slots; rows of all of them run in one step)"),
    "max_lora_rank": (16, "rank of every adapter slot; an adapter of higher rank is refused at load"),
}


def add_lora_args(p) -> None:
    """``--enable-lora``, ``--max-loras``, ``--max-lora-rank`` (``LORA_FLAGS``)."""
    g = p.add_argument_group("LoRA adapters (docs/server.md)")
    for name, (default, help_) in LORA_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            g.add_argument(flag, action="store_true", default=default, help=help_)
        else:
            g.add_argument(flag, type=int, default=default, help=f"{help_} (default {default})")


def add_lora_modules_arg(p) -> None:
    """``--lora-modules NAME=PATH ...`` (``atlas-vlm serve``; needs ``--enable-lora``)."""
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served from the start; a request picks one by model=NAME")


def lora_kwargs(args) -> dict:
    """The ``LoRAConfig`` flags of parsed ``args`` as flat ``EngineConfig`` keywords (those present)."""
    return {name: getattr(args, name) for name in LORA_FLAGS if hasattr(args, name)}


def parse_lora_modules(items) -> list[tuple[str, str]]:
    """``["NAME=PATH", ...]`` -> ``[(NAME, PATH)]``.

    Raises:
        ValueError: an item without ``=``, or a name given twice.
    """
    out = []
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in dict(out):
            raise ValueError(f"--lora-modules names {name!r} twice")
        out.append((name, path))
    return out
