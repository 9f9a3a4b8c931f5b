"""``MultiModalOptions``: per-request image options, validated where they enter.

Scope: the typed replacement of the untyped ``mm_options`` dict (``min_pixels`` /
``max_pixels`` after ``smart_resize``). A dict is still accepted through
:meth:`MultiModalOptions.from_value`, which refuses any key it does not know, by name.
The pixel defaults themselves live once, in :mod:`mm_token_pipeline.resize`
(``DEFAULT_MIN_PIXELS`` / ``DEFAULT_MAX_PIXELS``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .resize import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

__all__ = ["MultiModalOptions"]


def _check_pixels(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (pixels), got {value!r}")


@dataclass(frozen=True, slots=True)
class MultiModalOptions:
    """Image options of one request (or one image item); ``None`` means "inherit".

    Fields:
        min_pixels: lower bound on each resized image's area, in pixels (qwen-vl-utils rule).
        max_pixels: upper bound on each resized image's area, in pixels; an image gives at
            most ``max_pixels // 28**2`` visual tokens.
        longest_edge: SmolVLM2's own bound: the resized image's longest edge, in pixels (its
            HF image processor's ``size["longest_edge"]``); refused by the Qwen families.

    Raises:
        ValueError: on creation, a non-positive or non-int bound, or ``min_pixels > max_pixels``
            when both are set (the message names the field).
    """

    min_pixels: int | None = None
    max_pixels: int | None = None
    longest_edge: int | None = None

    def __post_init__(self) -> None:
        _check_pixels("min_pixels", self.min_pixels)
        _check_pixels("max_pixels", self.max_pixels)
        _check_pixels("longest_edge", self.longest_edge)
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")

    @classmethod
    def from_value(cls, value, *, where: str = "mm_options") -> "MultiModalOptions":
        """``None`` | dict | ``MultiModalOptions`` -> ``MultiModalOptions``.

        Raises:
            ValueError: a dict key that is not a field (named, with the known ones listed).
            TypeError: any other type.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise TypeError(f"{where} must be a MultiModalOptions, a dict or None, got {type(value).__name__}")

    def merged_over(self, base: "MultiModalOptions") -> "MultiModalOptions":
        """These options with every ``None`` field taken from ``base`` (validated again)."""
        return replace(base, **{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})

    def resolved(self) -> tuple[int, int]:
        """``(min_pixels, max_pixels)`` with ``DEFAULT_MIN_PIXELS`` / ``DEFAULT_MAX_PIXELS``
        for unset fields.

        Raises:
            ValueError: the resolved pair has ``min_pixels > max_pixels``.
        """
        lo = DEFAULT_MIN_PIXELS if self.min_pixels is None else self.min_pixels
        hi = DEFAULT_MAX_PIXELS if self.max_pixels is None else self.max_pixels
        if lo > hi:
            raise ValueError(f"min_pixels ({lo}) must be <= max_pixels ({hi})")
        return lo, hi
