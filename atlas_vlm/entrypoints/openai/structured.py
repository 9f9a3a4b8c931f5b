"""Request fields -> ``StructuredOutputsParams``: OpenAI's ``response_format``
(``json_object``, ``json_schema``) and vLLM's extras (``structured_outputs``,
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``), at most one of them.
"""

from __future__ import annotations

from atlas_vlm.entrypoints.openai.protocol import APIError
from atlas_vlm.structured_output import StructuredOutputsParams


def structured_outputs_from_request(req) -> StructuredOutputsParams | None:
    """The request's output constraint, or None.

    Raises:
        APIError(400): more than one constraint field, a ``json_schema`` format without a
            schema, or a schema / regex / grammar the grammar library refuses (``param``
            names the field).
    """
    found: list[tuple[str, dict]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError(400, "response_format.json_schema.schema is required for type 'json_schema'",
                               "response_format.json_schema", "invalid_value")
            from atlas_vlm.entrypoints.openai.schema_check import check_request_schema

            check_request_schema(rf.json_schema.json_schema, "response_format.json_schema.schema")
            found.append(("response_format", {"json": rf.json_schema.json_schema}))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        fields = so.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", fields))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name, None) is not None:
            found.append((name, {key: getattr(req, name)}))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, f"at most one output constraint per request; got {[f for f, _ in found]}",
                       found[1][0], "invalid_value")
    param, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:  # "structured_outputs.json is not supported: ..." named by the field
        msg = str(e).replace("structured_outputs.", f"{param}." if param != "structured_outputs" else "structured_outputs.", 1)
        raise APIError(400, msg if msg.startswith(param) else f"{param}: {msg}", param, "invalid_value") from e
