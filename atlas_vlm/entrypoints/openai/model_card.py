"""``/v1/models`` entries: OpenAI's model object plus what the model takes, for clients and
the chat page (issue 35, item 4). Each card carries, besides ``id`` / ``object`` /
``created`` / ``owned_by`` / ``root`` / ``parent`` (vLLM's fields):

- ``capabilities``: a subset of ``CAPABILITIES``, in that order: ``text`` (always),
  ``image`` / ``video`` (the model family's modalities, ``ModelFamily.modalities``),
  ``tools`` (the chat template takes ``tools``), ``reasoning`` (a ``--reasoning-parser``
  splits thinking), ``embeddings`` (``/v1/embeddings`` pools every model);
- ``max_model_len``: tokens per request (prompt + output);
- ``quantization``: the weight quantization (``--quantization``, else the checkpoint's
  ``quantization_config.quant_method``), or null for dense weights;
- ``random_weights``: the checkpoint has random weights (``default_models.has_random_weights``).

``root`` is the served name too: the model's path never appears in a response.
"""

from __future__ import annotations

from dataclasses import dataclass

CAPABILITIES = ("text", "image", "video", "tools", "reasoning", "embeddings")


@dataclass(frozen=True)
class ModelInfo:
    """What a served model takes (see the module docstring)."""

    capabilities: tuple[str, ...] = ("text", "embeddings")
    quantization: str | None = None
    random_weights: bool = False


def _quantization(engine_config, hf_config) -> str | None:
    method = engine_config.model_config.quantization
    if method:
        return str(method)
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) else getattr(qc, "to_dict", lambda: {})()
    return qc.get("quant_method") if isinstance(qc, dict) and qc.get("quant_method") else None


def _modalities(hf_config, is_vlm: bool) -> tuple[str, ...]:
    from atlas_vlm.models.registry import resolve_family

    try:
        return tuple(resolve_family(hf_config).modalities)
    except Exception:  # noqa: BLE001 - an unregistered config (a test stand-in): images iff a vision tower
        return ("image",) if is_vlm else ()


def model_info(engine, engine_config, *, is_vlm: bool, reasoning_parser=None, tool_parser=None) -> ModelInfo:
    """The ``ModelInfo`` of a built ``LLMEngine`` and its ``EngineConfig``.

    Args:
        is_vlm: the model has a vision tower (``ServerContext.is_vlm``).
        reasoning_parser: the server's reasoning parser (None: no ``reasoning``).
        tool_parser: the ``--tool-call-parser`` class (None: ``tools`` iff the chat template
            mentions ``tools``).
    """
    from atlas_vlm.default_models import has_random_weights

    mods = _modalities(engine.hf_config, is_vlm) if is_vlm else ()
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(map(str, template.values())) \
        if isinstance(template, dict) else str(template)
    has = {"text": True, "image": "image" in mods, "video": "video" in mods,
           "tools": tool_parser is not None or "tools" in template, "reasoning": reasoning_parser is not None,
           "embeddings": True}
    return ModelInfo(tuple(c for c in CAPABILITIES if has[c]), _quantization(engine_config, engine.hf_config),
                     has_random_weights(engine_config.model_config.model))


def model_card(name: str, created: int, max_model_len: int, info: ModelInfo | None, is_vlm: bool = False) -> dict:
    """One ``/v1/models`` entry for served name ``name`` (``info`` None: a front without an
    engine at hand, the Ray ingress: text, images iff ``is_vlm``, embeddings)."""
    if info is None:
        info = ModelInfo(("text", "image", "embeddings") if is_vlm else ("text", "embeddings"))
    return {"id": name, "object": "model", "created": created, "owned_by": "atlas-vlm", "root": name,
            "parent": None, "max_model_len": max_model_len, "capabilities": list(info.capabilities),
            "quantization": info.quantization, "random_weights": info.random_weights}


def model_card_schema() -> dict:
    """The OpenAPI schema of one card (``components/schemas/Model``)."""
    return {"type": "object", "required": ["id", "object", "created", "owned_by", "root", "max_model_len",
                                           "capabilities", "quantization", "random_weights"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"},
                           "root": {"type": "string"}, "parent": {"type": ["string", "null"]},
                           "max_model_len": {"type": "integer"},
                           "capabilities": {"type": "array", "items": {"type": "string", "enum": list(CAPABILITIES)}},
                           "quantization": {"type": ["string", "null"]}, "random_weights": {"type": "boolean"}}}
