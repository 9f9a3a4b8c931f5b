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
from mm_token_pipeline import MultiModalOptions
from mm_token_pipeline.fetch_policy import MediaFetchPolicy

#: Flat keywords of the policy's fields whose names differ (the rest keep theirs).
MEDIA_FLAT_NAMES = {"http_timeout_s": "http_image_timeout_s", "max_image_bytes": "http_image_max_bytes"}


@dataclass
class MultiModalConfig:
    """Media settings.

    Raises:
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    # per-image area bounds after smart_resize (pixels); None: the checkpoint's own
    # (preprocessor_config.json, models.processor_settings.image_processor_settings)
    min_pixels: int | None = None
    max_pixels: int | None = None
    limit_request_pixels: bool = False  # requests may lower max_pixels, never raise it (the server sets this)
    # http(s) media: whether fetched, timeout, byte caps, allowed hosts, redirects; the server's
    # MediaPolicy is this policy plus its local-file rule (atlas_vlm.entrypoints.openai.media)
    media: MediaFetchPolicy = field(default_factory=MediaFetchPolicy, metadata=flat(names=MEDIA_FLAT_NAMES))

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
