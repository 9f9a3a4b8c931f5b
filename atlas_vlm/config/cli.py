"""Command-line flags generated from settings dataclasses, and back (vLLM's
``EngineArgs.add_cli_args``): a field is a flag, its docstring the help.

Scope: ``add_flags(parser, cls)`` adds one flag per field of ``cls`` (a nested dataclass
field: one per field of the nested class): the name is the field's with ``-`` (or
``flag(name=...)``), the type from the annotation (``int``, ``float``, ``str``, ``X | None``,
``list[str]``: ``nargs="+"``, ``bool``: ``--x`` / ``--no-x``), the default the field's, the
help ``attr_docs`` plus the default, choices / metavar / byte sizes / a converter from
``flag(...)`` metadata; a field marked ``flag(skip=REASON)`` (or named in ``exclude``) gets
none. ``flag_values(args, cls)`` reads the parsed flags back as the nested field values
``cls`` is built from. Adding a setting is one field with a docstring (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, fields, is_dataclass

from atlas_vlm.config.docs import attr_docs

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


def format_bytes(n: int) -> str:
    """``n`` bytes as the largest whole binary (``20MiB``) or decimal (``200MB``) unit, else bytes."""
    for name, unit in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("TB", 10**12), ("GB", 10**9),
                       ("MB", 10**6), ("KB", 10**3)):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


ADDED = "_config_flags"  # namespace attribute: the dests add_flags added
UNSET = type("Unset", (), {"__repr__": lambda self: "UNSET"})()  # Flag.default not given: the field's


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line (``dataclasses.field`` metadata ``"cli"``).

    ``name``: the flag without ``--`` (default: the field's name with ``-``); ``type`` /
    ``choices`` (a sequence, or a callable returning one, read when the parser is built) /
    ``metavar`` / ``default`` (the flag's, where it differs from the field's: e.g. None for
    "not given, the field's default") as argparse's; ``bytes``: a byte size (``512MiB``);
    ``convert``: flag value -> field value (None passes through); ``requires``: the ``dest``
    of a flag that must be given with this one; ``help``: text after the docstring;
    ``group``: the argparse group title; ``sub``: a nested dataclass field's ``{field: Flag}``;
    ``skip``: why this field has no flag (it then has none).
    """

    name: str | None = None
    type: typing.Callable | None = None
    choices: typing.Any = None
    metavar: str | None = None
    default: typing.Any = UNSET
    bytes: bool = False
    convert: typing.Callable | None = None
    requires: str | None = None
    help: str | None = None
    group: str | None = None
    sub: dict | None = None
    skip: str | None = None


def flag(**kwargs) -> dict:
    """``dataclasses.field`` metadata holding a :class:`Flag` (``Flag``'s keywords); merge it with
    ``flat(...)``'s as ``{**flat(..), **flag(..)}``."""
    return {"cli": Flag(**kwargs)}


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


@dataclass(frozen=True)
class FlagSpec:
    """One generated flag: ``path`` of field names from the class, the option and its dest,
    argparse keywords, and the field's :class:`Flag`."""

    path: tuple[str, ...]
    option: str
    dest: str
    kwargs: dict
    meta: Flag


def flag_specs(cls: type, overrides: dict | None = None, _path: tuple = (), _sub: dict | None = None) -> list[FlagSpec]:
    """The flags of ``cls``'s fields, in field order (skipped fields left out).
    ``overrides``: ``{field name: {Flag attribute: value}}`` over a field's own ``Flag`` (a
    command's own default, choices or help)."""
    hints, docs, specs = typing.get_type_hints(cls), attr_docs(cls), []
    for f in fields(cls):
        meta = (_sub or {}).get(f.name) or f.metadata.get("cli") or Flag()
        if f.name in (overrides or {}):
            meta = dataclasses.replace(meta, **overrides[f.name])
        if meta.skip:
            continue
        nested = f.default_factory if is_dataclass(f.default_factory) else None
        if nested is not None:
            specs += flag_specs(nested, overrides, _path + (f.name,), meta.sub)
            continue
        specs.append(_spec(f, hints[f.name], docs.get(f.name, ""), meta, _path + (f.name,)))
    return specs


def _spec(f: dataclasses.Field, hint, doc: str, meta: Flag, path: tuple) -> FlagSpec:
    name = meta.name or f.name.replace("_", "-")
    default = _field_default(f) if meta.default is UNSET else meta.default
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    kw: dict = {"default": default}
    if base is bool and meta.type is None:
        kw["action"] = argparse.BooleanOptionalAction  # --x / --no-x
    else:
        if typing.get_origin(base) is list:
            kw["nargs"], base = "+", typing.get_args(base)[0]
        kw["type"] = meta.type or (bytes_arg() if meta.bytes else base)
    choices = meta.choices() if callable(meta.choices) else meta.choices
    if choices is not None:
        kw["choices"] = [c for c in choices if c is not None]
    if meta.metavar or meta.bytes:
        kw["metavar"] = meta.metavar or "BYTES"
    text = " ".join(t for t in (doc, meta.help) if t)
    if default is not None:
        text += f" (default: {format_bytes(default) if meta.bytes else default})"
    kw["help"] = text.replace("%", "%%")
    return FlagSpec(path, "--" + name, name.replace("-", "_"), kw, meta)


def add_flags(parser, cls: type, *, exclude=(), only=None, overrides: dict | None = None,
              group: str | None = None) -> list[FlagSpec]:
    """Add the flags of ``cls`` (less the field names in ``exclude``; only those in ``only``
    when given) to ``parser``, in one argument group titled ``group`` (None: ``parser``
    itself) or each field's ``Flag.group``; ``overrides`` as ``flag_specs``'s."""
    specs = [s for s in flag_specs(cls, overrides) if s.path[-1] not in exclude and s.path[0] not in exclude
             and (only is None or s.path[-1] in only)]
    groups: dict = {}
    for s in specs:
        title = s.meta.group or group
        if title is not None and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = parser if title is None else groups[title]
        target.add_argument(s.option, dest=s.dest, **s.kwargs)
    # the parsed namespace records which dests are generated flags: flag_values reads only those
    # (a command's own flag of the same dest, e.g. generate's sampling --seed, is not a field's)
    parser.set_defaults(**{ADDED: (parser.get_default(ADDED) or frozenset()) | {s.dest for s in specs}})
    return specs


def flag_values(args: argparse.Namespace, cls: type, *, overrides: dict | None = None) -> dict:
    """The nested ``{field: value}`` (a nested dataclass field: a dict of its own) of the
    flags of ``cls`` that ``args`` holds (that ``add_flags`` added, where ``args`` records it);
    a flag whose value is None while its field's default is not (``Flag(default=None)``: not
    given) is left out, so the field keeps its default.

    Raises:
        ValueError: a ``convert`` refused the value, or a flag given without the flag it
            ``requires`` (the message names both).
    """
    out: dict = {}
    added = getattr(args, ADDED, None)
    for s in flag_specs(cls, overrides):
        if not hasattr(args, s.dest) or (added is not None and s.dest not in added):
            continue
        value = getattr(args, s.dest)
        if value is None and s.meta.default is None:
            continue
        if s.meta.requires and getattr(args, s.meta.requires, None) is None:
            raise ValueError(f"{s.option} needs --{s.meta.requires.replace('_', '-')}")
        if s.meta.convert is not None and value is not None:
            value = s.meta.convert(value)
        into = out
        for part in s.path[:-1]:
            into = into.setdefault(part, {})
        into[s.path[-1]] = value
    return out
