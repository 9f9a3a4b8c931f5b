"""JSON schemas a request brings (each tool's ``function.parameters``, ``response_format``'s
``json_schema.schema``) checked when the request arrives, named by their request path.

Scope: ``check_request_schema`` runs ``jsonschema``'s metaschema check (the draft the schema's
``$schema`` names, else Draft 2020-12) and then asks the grammar backend (``structured_output``) whether it
compiles the schema; a failure is a 400 naming the field and the path inside the schema
(``tools[0].function.parameters.properties.x.type: 'strin' is not valid under any of the given
schemas``), never the grammar the server builds from it. Tools are checked under every
``tool_choice`` (none / auto / required / named), as OpenAI does.
"""

from __future__ import annotations

from atlas_vlm.entrypoints.openai.protocol import APIError


def _dotted(base: str, path) -> str:
    """``base`` + the schema path (``["properties", "x", "type"]`` -> ``.properties.x.type``;
    list indices as ``[i]``)."""
    out = base
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def check_request_schema(schema, param: str) -> None:
    """Check one JSON schema of a request.

    Args:
        schema: the schema (a dict; a bool is a valid schema too).
        param: its request path, e.g. ``tools[0].function.parameters``.

    Raises:
        APIError(400, param): not a valid JSON schema (the message names the path inside the
            schema and what is wrong there), or one the grammar backend does not support.
    """
    import jsonschema
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param,
                       "invalid_value")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as e:
        where = _dotted(param, e.path)
        raise APIError(400, f"{where}: {e.message}", param, "invalid_value") from None
    from atlas_vlm.structured_output import StructuredOutputsParams

    try:
        StructuredOutputsParams(json=schema)  # validated by the backend on creation
    except (ValueError, TypeError) as e:
        msg = str(e).removeprefix("structured_outputs.json is not supported: ").removeprefix("structured_outputs.json: ")
        raise APIError(400, f"{param}: this JSON schema is not supported by the server: {msg}", param,
                       "invalid_value") from None


def check_tool_schemas(tools) -> None:
    """Check each tool's ``function.parameters`` (``tools`` as request models or dicts; a tool
    without parameters is fine).

    Raises:
        APIError(400, ``tools[i].function.parameters``): as ``check_request_schema``.
    """
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else getattr(tool, "function", None)
        params = (fn.get("parameters") if isinstance(fn, dict) else getattr(fn, "parameters", None)) if fn else None
        if params is not None:
            check_request_schema(params, f"tools[{i}].function.parameters")
