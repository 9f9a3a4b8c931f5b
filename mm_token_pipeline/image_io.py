"""Image loading and normalisation to 8-bit RGB, and the ``ImageInputError`` type.

Scope: ``load_image`` turns every accepted source (path, ``file://`` URI, ``data:`` URI,
bytes, ``PIL.Image``, opt-in ``http(s)://`` URL) into one upright RGB ``PIL.Image``, and
refuses bad input (empty, truncated, not an image, decompression bomb) with an
``ImageInputError`` that names the source and the cause. Decoding is Pillow's; the
source forms follow qwen-vl-utils ``fetch_image``; the mode handling extends its ``to_rgb``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .fetch_policy import DEFAULT_HTTP_MAX_BYTES, DEFAULT_HTTP_TIMEOUT_S, MediaFetchPolicy, MediaRefused
from .http_fetch import DownloadError, fetch_url

__all__ = ["ImageInputError", "load_image", "to_rgb", "DEFAULT_MAX_IMAGE_PIXELS", "DEFAULT_HTTP_TIMEOUT_S",
           "DEFAULT_HTTP_MAX_BYTES"]


class ImageInputError(ValueError):
    """Bad image input.

    The message always names the source (a file path, ``'bytes'``, a ``data:`` URI prefix
    or a URL) and the cause (empty file, truncated data, not an image, decompression bomb,
    aspect ratio over the limit 200, HTTP refused, ...).

    Subclasses ``ValueError`` so that code written against qwen-vl-utils (which raises
    ``ValueError`` for the aspect-ratio rule) keeps working.
    """

    def __init__(self, source: str, cause: str) -> None:
        self.source = source
        self.cause = cause
        super().__init__(f"image input {source!s}: {cause}")


#: Largest declared image area accepted, in pixels (Pillow's own default bomb limit).
DEFAULT_MAX_IMAGE_PIXELS: int = 89_478_485
_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def _read_source(source, allow_http: bool, http_timeout_s: float, max_http_bytes: int,
                 policy: MediaFetchPolicy | None = None):
    """Return ``(name, bytes_or_path)`` for a non-PIL source; raises ImageInputError."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "bytes", bytes(source)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise ImageInputError(repr(type(source).__name__), "unsupported image source type")
    if source.startswith("data:"):
        name = source[:30] + "..."
        if not source.startswith("data:image") or "base64," not in source:
            raise ImageInputError(name, "data URI must be 'data:image/...;base64,...'")
        try:
            return name, base64.b64decode(source.split("base64,", 1)[1], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageInputError(name, f"invalid base64 data ({exc})") from exc
    if source.startswith(("http://", "https://")):
        if not allow_http:
            raise ImageInputError(source, "HTTP(S) download refused (allow_http=False)")
        try:
            return source, fetch_url(source, timeout_s=http_timeout_s, max_bytes=max_http_bytes, policy=policy)
        except (DownloadError, MediaRefused) as exc:
            raise ImageInputError(source, str(exc)) from exc
    path = source[len("file://"):] if source.startswith("file://") else source
    if not os.path.isfile(path):
        raise ImageInputError(path, "file not found")
    if os.path.getsize(path) == 0:
        raise ImageInputError(path, "empty file (0 bytes)")
    return path, path


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit ``RGB`` (a new image; size unchanged).

    Rules: transparency (RGBA, LA, PA, P or L/RGB with a ``transparency`` key) is composited
    on white, as qwen-vl-utils ``to_rgb`` does for RGBA; 16-bit grey (``I;16*``, ``I``) is
    scaled by 1/257 (65535 -> 255), not clipped; CMYK, ``1``, ``L``, ``YCbCr``... use
    Pillow's ``convert('RGB')``.
    """
    if image.mode in _SIXTEEN_BIT_MODES:
        arr = np.asarray(image, dtype=np.float64)  # [h, w]
        arr = np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8)
        image = Image.fromarray(arr, mode="L")
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(
    source,
    *,
    allow_http: bool = False,
    http_timeout_s: float = DEFAULT_HTTP_TIMEOUT_S,
    max_http_bytes: int = DEFAULT_HTTP_MAX_BYTES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    fetch_policy: MediaFetchPolicy | None = None,
) -> Image.Image:
    """Load one image as an upright 8-bit RGB ``PIL.Image`` (size w x h in pixels).

    Args:
        source: str path, ``file://`` URI, ``data:image/...;base64,...`` URI, bytes,
            ``PIL.Image.Image``, or an ``http(s)://`` URL (refused unless ``allow_http``).
        allow_http: permit URL downloads (see :func:`mm_token_pipeline.http_fetch.fetch_url`).
        http_timeout_s: overall deadline of one download in seconds (connect, headers and
            body together: a server that drips bytes is cut off at the deadline).
        max_http_bytes: byte cap of one download (declared ``Content-Length`` or received).
        max_image_pixels: largest declared w*h accepted, checked before decoding. Pillow's own
            ``DecompressionBombError`` (over 2 * ``Image.MAX_IMAGE_PIXELS``) is also reported.
        fetch_policy: a ``MediaFetchPolicy`` (the engine's): when given, it replaces the three
            http arguments (``allow_http_images``, ``http_timeout_s``, ``max_image_bytes``) and
            every hop is checked as the server checks it (``fetch_policy`` module).

    Steps: EXIF orientation (``PIL.ImageOps.exif_transpose``), first frame of animations,
    full decode (``.load()``, so truncated data fails here), then :func:`to_rgb`.

    Raises:
        ImageInputError: file not found, empty file, not an image, truncated/corrupt data,
            declared size over ``max_image_pixels`` (or Pillow's ``DecompressionBombError``),
            bad data URI, refused, failed, late (``http_timeout_s``) or oversized
            (``max_http_bytes``) download. The message names the source.
    """
    if isinstance(source, Image.Image):
        name, image = "PIL.Image", source
    else:
        if fetch_policy is not None:
            allow_http, http_timeout_s = fetch_policy.allow_http_images, fetch_policy.http_timeout_s
            max_http_bytes = fetch_policy.max_image_bytes
        name, payload = _read_source(source, allow_http, http_timeout_s, max_http_bytes, fetch_policy)
        if isinstance(payload, bytes) and not payload:
            raise ImageInputError(name, "empty data (0 bytes)")
        fp = io.BytesIO(payload) if isinstance(payload, bytes) else payload
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(fp)
        except Image.DecompressionBombError as exc:
            raise ImageInputError(name, f"decompression bomb refused ({exc})") from exc
        except UnidentifiedImageError as exc:
            raise ImageInputError(name, "not an image (unrecognised format)") from exc
        except OSError as exc:
            raise ImageInputError(name, f"cannot open image ({exc})") from exc
    w, h = image.size
    if w * h > max_image_pixels:
        raise ImageInputError(
            name, f"decompression bomb refused: declared {w}x{h} exceeds {max_image_pixels} pixels"
        )
    try:
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)
        image.load()
        return to_rgb(ImageOps.exif_transpose(image))
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageInputError(name, f"truncated or corrupt image data ({exc})") from exc
    finally:
        if image is not source:
            image.close()
