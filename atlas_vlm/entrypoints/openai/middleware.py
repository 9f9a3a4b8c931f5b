"""The server's error responses and its two plain ASGI middlewares (request body limit, API
key): every refusal they make is the route family's error JSON (OpenAI's, or Anthropic's under
``/v1/messages``)."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from atlas_vlm.entrypoints.anthropic.protocol import error_body
from atlas_vlm.entrypoints.openai.protocol import APIError

RETRY_AFTER_S = 1  # seconds a 503 asks the client to wait
DEFAULT_BODY_MARGIN_BYTES = 1 << 20  # JSON around one image at the byte cap


def default_max_request_body_bytes(max_image_bytes: int) -> int:
    """Default ``--max-request-body-bytes``: one image at ``max_image_bytes`` as a base64
    ``data:`` URI (4/3 of its bytes) plus 1 MiB for the rest of the JSON."""
    return (max_image_bytes + 2) // 3 * 4 + DEFAULT_BODY_MARGIN_BYTES


ANTHROPIC_PREFIX = "/v1/messages"  # routes answering Anthropic's error JSON


def error_response(e: APIError, path: str = "") -> JSONResponse:
    """The error response: OpenAI's JSON, or Anthropic's under ``ANTHROPIC_PREFIX``."""
    headers = dict(e.headers)
    if e.status == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    anthropic = path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")
    return JSONResponse(error_body(e) if anthropic else e.body(), status_code=e.status, headers=headers)


class _BodyTooLarge(HTTPException):
    """Raised while the body is read (FastAPI lets ``HTTPException`` through its body parsing)."""

    code = "request_too_large"


class BodyLimitMiddleware:
    """413 for a request body over ``limit`` bytes: at once from ``Content-Length``, else
    (chunked) as soon as the bytes read pass it. Plain ASGI, so disconnects stay visible."""

    def __init__(self, app, limit: int, overrides: dict[str, tuple[int, str]] | None = None):
        """``overrides``: ``{path: (limit, flag)}``, another limit (named by its flag) for
        requests to ``path`` exactly (``/v1/files`` uploads: ``--max-file-bytes``)."""
        self.app, self.limit, self.overrides = app, limit, dict(overrides or {})

    def _message(self, limit: int, flag: str, size: int | None) -> str:
        got = f" ({size} bytes)" if size is not None else ""
        return f"request body is over the {limit}-byte limit{got} ({flag})"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, flag = self.overrides.get(scope["path"], (self.limit, "--max-request-body-bytes"))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await error_response(APIError(413, self._message(limit, flag, int(length)), None, _BodyTooLarge.code),
                         scope["path"])(scope, receive, send)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(413, self._message(limit, flag, None))
            return message

        await self.app(scope, limited_receive, send)


class APIKeyMiddleware:
    """Plain ASGI middleware (not ``BaseHTTPMiddleware``, which wraps ``receive`` and hides a
    client's disconnect from the routes): 401 on guarded paths without ``Bearer KEY`` or
    (Anthropic's clients) ``x-api-key: KEY`` (``hmac.compare_digest``: the time taken says
    nothing about the key)."""

    DOCS_AND_METRICS = ("/docs", "/redoc", "/openapi.json", "/metrics")
    ALSO_GUARDED = ("/tokenize", "/detokenize")  # outside /v1, but they run the model's tokenizer

    def __init__(self, app, api_key: str, protect_docs_metrics: bool = False):
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()
        self.protect_docs_metrics = protect_docs_metrics

    def _guarded(self, path: str) -> bool:
        if path.startswith("/v1") or path in self.ALSO_GUARDED:
            return True
        return self.protect_docs_metrics and any(path == p or path.startswith(p + "/") for p in self.DOCS_AND_METRICS)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._guarded(scope["path"]):
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer or x_api_key):
                err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or "
                               "'x-api-key: KEY')", None, "invalid_api_key")
                await error_response(err, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
