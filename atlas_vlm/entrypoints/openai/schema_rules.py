"""JSON-schema statements of request rules that pydantic's types do not state by themselves
(issue 35: the served schema tells the truth), for models' ``json_schema_extra``: several
fields of which exactly one or at most one holds a value, non-empty prompts, float32 bounds.
The validators that enforce the rules stay where they are; these only state them."""

from __future__ import annotations

NOT_NULL = {"not": {"type": "null"}}  # any value but null
FLOAT32_INF = 2.0 ** 128 - 2.0 ** 103  # the least double that rounds to inf in float32
FLOAT32_ZERO = 2.0 ** -150  # the greatest double that rounds to 0 in float32


def exactly_one(*names: str) -> dict:
    """A JSON schema (for a model's ``json_schema_extra``): exactly one of the fields ``names``
    holds a value (is present and not null)."""
    return {"oneOf": [{"required": [k], "properties": {k: NOT_NULL}} for k in names]}


def non_empty_prompt(schema: dict) -> None:
    """``json_schema_extra`` of a prompt field (a string, a list of strings, token ids or lists
    of token ids): every branch non-empty, as the server refuses an empty prompt."""
    for branch in schema.get("anyOf", []):
        items = branch.get("items") or {}
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1
            if items.get("type") == "string":
                items["minLength"] = 1
            elif items.get("type") == "integer":
                items["minimum"] = 0  # token ids (their bound, the vocabulary, is the model's)
            elif items.get("type") == "array":
                items["minItems"] = 1
                items.setdefault("items", {})["minimum"] = 0


def at_most_one(counted: dict[str, dict]) -> dict:
    """A JSON schema (for a model's ``json_schema_extra``) stating that at most one of the
    fields in ``counted`` holds a value the request counts: no two of them together.

    Args:
        counted: field name -> the schema its value matches when it counts (e.g. not null).
    """
    names = list(counted)
    pairs = [{"required": [a, b], "properties": {a: counted[a], b: counted[b]}}
             for i, a in enumerate(names) for b in names[i + 1:]]
    return {"not": {"anyOf": pairs}}
