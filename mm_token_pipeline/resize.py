"""Target size of an image before patchifying: ``smart_resize``.

Scope: one function that applies qwen-vl-utils' resize rule
(``qwen_vl_utils.vision_process.smart_resize``: both sides multiples of ``factor`` pixels,
area within ``[min_pixels, max_pixels]``, aspect ratio kept, ratio over 200 refused),
validates its arguments with clear errors, and wraps one known fault of qwen-vl-utils
0.0.14: for very thin images the ``max_pixels`` branch floors the short side to 0 pixels.
"""

from __future__ import annotations

import math

from qwen_vl_utils import vision_process as _qvu

from .image_io import ImageInputError

__all__ = ["smart_resize", "MAX_ASPECT_RATIO", "DEFAULT_MIN_PIXELS", "DEFAULT_MAX_PIXELS"]

#: Largest accepted ``max(h, w) / min(h, w)`` (qwen-vl-utils ``MAX_RATIO``).
MAX_ASPECT_RATIO: int = _qvu.MAX_RATIO
#: Default lower bound on the resized area, in pixels (4 merged patches of 28x28).
DEFAULT_MIN_PIXELS: int = 4 * 28 * 28
#: Default upper bound on the resized area, in pixels (16384 merged patches of 28x28).
DEFAULT_MAX_PIXELS: int = 16384 * 28 * 28


def smart_resize(
    height: int,
    width: int,
    *,
    factor: int = 28,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    source: str = "image",
) -> tuple[int, int]:
    """Return ``(resized_height, resized_width)`` in pixels for an image of ``height x width``.

    Rules (qwen-vl-utils 0.0.14 ``smart_resize``, called here): both sides are multiples of
    ``factor`` (28 = patch 14 x merge 2), the area is within ``[min_pixels, max_pixels]``
    whenever the aspect ratio allows it, and the aspect ratio is kept as closely as possible.
    The number of visual tokens is ``resized_height * resized_width / factor**2``, which never
    exceeds ``max_pixels / factor**2``.

    Fault wrapped: qwen-vl-utils floors a thin side to 0 when the ``max_pixels`` branch is
    taken (h=639, w=31, max_pixels=20*784 gives (560, 0)); each side is clamped to at least
    ``factor`` and, if the area then exceeds ``max_pixels``, the long side is floored again.
    With the fix that case gives (560, 28).

    Args:
        height, width: original size in pixels, both > 0.
        factor: side granularity in pixels.
        min_pixels, max_pixels: bounds on the resized area in pixels.
        source: name used in error messages (file path, 'bytes', ...).

    Raises:
        ValueError: non-positive sizes, ``min_pixels > max_pixels`` (qwen-vl-utils only has a
            bare assert), or ``max_pixels < factor**2`` (no valid size exists).
        ImageInputError: aspect ratio over ``MAX_ASPECT_RATIO`` (200); the message names the limit.
    """
    if int(height) <= 0 or int(width) <= 0:
        raise ValueError(f"{source}: height and width must be > 0 pixels, got {height}x{width}")
    if factor <= 0:
        raise ValueError(f"factor must be > 0 pixels, got {factor}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must be <= max_pixels ({max_pixels})")
    if max_pixels < factor * factor:
        raise ValueError(f"max_pixels ({max_pixels}) is below one {factor}x{factor} tile")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageInputError(
            source,
            f"aspect ratio {ratio:.2f} ({width}x{height} w x h) exceeds the limit {MAX_ASPECT_RATIO}",
        )
    h_bar, w_bar = _qvu.smart_resize(
        int(height), int(width), factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    # Known fault: a side floored to 0 by the max_pixels branch.
    h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
    if h_bar * w_bar > max_pixels:
        if h_bar >= w_bar:
            h_bar = max(factor, math.floor(max_pixels / w_bar / factor) * factor)
        else:
            w_bar = max(factor, math.floor(max_pixels / h_bar / factor) * factor)
    return h_bar, w_bar
