"""``StructuredOutputsParams``: what a request's output must match (vLLM's
``vllm.sampling_params.StructuredOutputsParams``): exactly one of ``json`` (a JSON schema as a
dict, a JSON string or a pydantic model class), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings) or ``grammar`` (Lark, as llguidance takes it; GBNF is
translated by the library).

The spec is checked when the object is created (JSON syntax, schema features the grammar
library does not support, regex and grammar syntax), so a request is never run silently
unconstrained; the tokenizer-dependent part (compiling) happens when the request is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _schema_of(value, where: str) -> dict | bool:
    """A JSON schema (dict) from a dict, a JSON string or a pydantic ``BaseModel`` class."""
    if isinstance(value, type):
        schema = getattr(value, "model_json_schema", None)
        if schema is None:
            raise ValueError(f"{where}: a class must be a pydantic BaseModel, got {value.__name__}")
        return schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
    if isinstance(value, bool):  # true / false are valid schemas
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON schema (dict, JSON string or pydantic model class), "
                         f"got {type(value).__name__}")
    return value


_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]",
                  "s": "[\\t\\n\\x0B\\x0C\\r ]", "S": "[^\\t\\n\\x0B\\x0C\\r ]"}


def ascii_regex(regex: str) -> str:
    """``regex`` with the Perl classes ``\\d \\w \\s`` (and ``\\D \\W \\S``) spelled as their
    ASCII sets: ``[0-9]``, ``[0-9A-Za-z_]``, ``[\\t\\n\\v\\f\\r ]``.

    The grammar library reads Rust regex syntax, where ``\\d`` is any Unicode digit (``'٣'``
    too); Python's ``re.ASCII``, JSON schema's ECMA-262 ``pattern`` and xgrammar (vLLM's
    default) mean ASCII, which is what a ``\\d{3}-\\d{4}`` phone pattern expects. Inside a
    character class the set is nested (``[\\d-]`` -> ``[[0-9]-]``, Rust's nested-class
    syntax). Other escapes, ``\\p{...}`` included, are kept; an escaped backslash is skipped.
    """
    out, i = [], 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            out.append(_ASCII_CLASSES.get(nxt, c + nxt))
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


# the string formats the grammar library enforces (llguidance's JSON schema docs; each one
# checked against it in tests/engine/test_structured_output.py)
SUPPORTED_FORMATS = ("date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "time", "uri", "uuid")
_NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values here are data, not subschemas


def check_formats(schema, path: str = "") -> None:
    """Refuse a ``format`` the grammar library does not enforce, naming where it is.

    Args:
        schema: a JSON schema (dict / list / bool), walked recursively.
        path: where ``schema`` sits, dotted (``properties.contact``).

    Raises:
        ValueError: ``"format 'idn-email' at properties.contact is not supported (supported: ...)"``.
    """
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_formats(item, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"format {fmt!r} at {path or 'the schema root'} is not supported "
                         f"(supported: {', '.join(SUPPORTED_FORMATS)})")
    for key, value in schema.items():
        if key not in _NOT_SCHEMAS and isinstance(value, (dict, list)):
            check_formats(value, f"{path}.{key}" if path else key)


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped literally)."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a request's output.

    Args:
        json: JSON schema: dict, JSON string, or a pydantic ``BaseModel`` subclass; string
            ``format`` is enforced for ``SUPPORTED_FORMATS`` (date, date-time, duration, email,
            hostname, ipv4, ipv6, time, uri, uuid) and any other is refused.
        json_object: True: any JSON object (``response_format={"type": "json_object"}``).
        regex: the whole output must ``re.fullmatch`` it (Rust regex syntax, no lookaround;
            ``\\d``, ``\\w``, ``\\s`` are ASCII as in xgrammar / vLLM: see ``ascii_regex``).
        choice: the output is exactly one of these non-empty strings.
        grammar: a Lark grammar (llguidance's dialect; ``%json {...}`` embeds a schema).

    Raises:
        ValueError: none or more than one constraint given, a wrong type, invalid JSON, or
            a schema / regex / grammar the grammar library refuses (its message names the
            unsupported keyword or the syntax error).
    """

    json: dict | str | type | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(KINDS)}, got "
                             f"{given or 'none'}")
        kind = given[0]
        if kind == "json":
            object.__setattr__(self, "json", _schema_of(self.json, "structured_outputs.json"))
            try:
                check_formats(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: {e}") from None
        elif kind == "json_object" and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True, got {self.json_object!r}")
        elif kind in ("regex", "grammar") and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {getattr(self, kind)!r}")
        elif kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        from atlas_vlm.structured_output.backend import validate

        validate(self)

    @property
    def kind(self) -> str:
        """Which constraint: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def __deepcopy__(self, memo):
        return self  # immutable once checked (SamplingParams is deep-copied per request)
