"""``MultiModalConfig``: images and videos (vLLM's ``MultiModalConfig``): the engine's pixel
bounds and the one media fetch policy (``MediaFetchPolicy``) that the engine's loaders and
the server's fetch both obey.

Scope: validated on creation (the messages name the flat ``EngineConfig(...)`` keyword:
``allow_http_images``, ``http_image_timeout_s``, ``http_image_max_bytes``, ...), and
``image_bounds`` (this config over the checkpoint's processor settings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atlas_vlm.config.checks import flat, is_int
from atlas_vlm.config.cli import Flag, flag
from mm_token_pipeline import MultiModalOptions
from mm_token_pipeline.fetch_policy import MediaFetchPolicy

#: Flat keywords of the policy's fields whose names differ (the rest keep theirs).
MEDIA_FLAT_NAMES = {"http_timeout_s": "http_image_timeout_s", "max_image_bytes": "http_image_max_bytes"}
#: The policy's flags (its field comments are their help): names as ``vllm serve``'s where it has one.
MEDIA_FLAGS = {"http_timeout_s": Flag(name="image-fetch-timeout"), "max_image_bytes": Flag(bytes=True),
               "max_video_bytes": Flag(bytes=True, help="A data: URI is also bounded by --max-request-body-bytes."),
               "allowed_media_domains": Flag(metavar="HOST", help="Used with --allow-http-images."),
               "max_redirects": Flag(name="max-media-redirects")}


@dataclass
class MultiModalConfig:
    """Media settings.

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    min_pixels: int | None = None
    """Per-image lower pixel bound after resize (smart_resize); None: the checkpoint's own
    (preprocessor_config.json, models.processor_settings.image_processor_settings)."""
    max_pixels: int | None = None
    """Per-image pixel bound after resize: one visual token per 28x28 px on Qwen2.5-VL, 32x32 on
    Qwen3-VL / Qwen3.5; SmolVLM2: longest edge floor(sqrt(P)) in whole tiles. None: the checkpoint's own."""
    limit_request_pixels: bool = field(default=False, metadata=flag(
        skip="set by the command: serve turns it on (a request may lower the server's image bounds, never "
             "raise them); generate and chat leave it off"))
    """Requests may lower max_pixels, never raise it (the server sets this)."""
    media: MediaFetchPolicy = field(default_factory=MediaFetchPolicy, metadata={
        **flat(names=MEDIA_FLAT_NAMES), **flag(sub=MEDIA_FLAGS)})
    """http(s) media: whether fetched, timeout, byte caps, allowed hosts, redirects; the server's
    MediaPolicy is this policy plus its local-file rule (atlas_vlm.entrypoints.openai.media)."""

    def __post_init__(self) -> None:
        if not isinstance(self.media, MediaFetchPolicy):
            raise ValueError(f"media must be a MediaFetchPolicy, got {type(self.media).__name__}")
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1 (pixels) or None (the checkpoint's), got {value!r}")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")

    def image_bounds(self, settings) -> MultiModalOptions:
        """The engine's image bounds: the checkpoint's ``settings``
        (``mm_token_pipeline.ImageProcessorSettings``) with this config's ``min_pixels`` /
        ``max_pixels`` over them. SmolVLM bounds by its processor's longest edge: only this
        config's own values are returned there.

        Raises:
            ValueError: the resolved ``min_pixels > max_pixels``; the message says where each
                came from (this config, i.e. ``--min-pixels`` / ``--max-pixels``, or the checkpoint).
        """
        if settings is None or settings.longest_edge is not None:
            return MultiModalOptions(min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        lo = settings.min_pixels if self.min_pixels is None else self.min_pixels
        hi = settings.max_pixels if self.max_pixels is None else self.max_pixels
        if lo > hi:
            def origin(mine, flag):
                return f"set by {flag}" if mine is not None else f"from {settings.source}"
            raise ValueError(f"max_pixels {hi} ({origin(self.max_pixels, 'max_pixels / --max-pixels')}) is below "
                             f"min_pixels {lo} ({origin(self.min_pixels, 'min_pixels / --min-pixels')}); "
                             "set both so that min_pixels <= max_pixels")
        return MultiModalOptions(min_pixels=lo, max_pixels=hi)
