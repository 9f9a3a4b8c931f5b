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


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped literally)."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a request's output.

    Args:
        json: JSON schema: dict, JSON string, or a pydantic ``BaseModel`` subclass.
        json_object: True: any JSON object (``response_format={"type": "json_object"}``).
        regex: the whole output must ``re.fullmatch`` it (Rust regex syntax, no lookaround).
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
