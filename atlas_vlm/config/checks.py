"""Shared helpers of the sub-configs: the flat-keyword alias of a field and value checks.

Scope: ``flat(name)`` marks a sub-config field whose flat ``EngineConfig(...)`` / ``LLM(...)``
keyword differs from the field's own name (``cache_config.block_size`` is ``kvcache_block_size``);
``flat_names`` renames the fields of a nested policy. The checks raise ``ValueError`` naming
the flat keyword, as ``EngineConfig`` did before it was split.
"""

from __future__ import annotations


def flat(name: str | None = None, *, names: dict[str, str] | None = None) -> dict:
    """``dataclasses.field`` metadata: this field's flat keyword is ``name``; for a nested
    dataclass field, ``names`` maps its fields to their flat keywords (others keep theirs)."""
    return {"flat": name, "flat_names": names or {}}


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(name: str, value, what: str = "") -> None:
    """Raises ValueError: ``value`` is not an int >= 1 (``what``: the unit, in the message)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{what}, got {value!r}")


def check_optional_positive(name: str, value, what: str) -> None:
    """Raises ValueError: ``value`` is neither None nor an int >= 1."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 ({what}) or None, got {value!r}")
