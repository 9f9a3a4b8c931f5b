"""The browser chat page of ``atlas-vlm serve``: ``GET /`` is ``static/index.html`` and
``GET /static/<file>`` its scripts and style sheets, shipped inside the package with the
libraries it uses (``static/vendor/``: markdown-it, KaTeX, highlight.js, DOMPurify, copied
from npm with their licenses; no build step, nothing fetched from the internet at run
time). The page only calls the server's own ``GET /v1/models`` and ``POST
/v1/chat/completions`` (streamed), so ``--api-key`` guards what it does and the page itself
stays open, as llama.cpp's server web UI does."""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"


def add_web_routes(app) -> None:
    """Add ``GET /`` (the page, ``text/html``) and the ``/static`` mount (Starlette's
    ``StaticFiles``: ``.js`` as ``text/javascript``, ``.css`` as ``text/css``; a missing file
    is the server's JSON 404) to the FastAPI ``app``. Neither appears in the OpenAPI schema.

    Raises:
        RuntimeError: the package was installed without its ``static`` folder (package data).
    """
    from fastapi.responses import FileResponse
    from starlette.staticfiles import StaticFiles

    index = STATIC_DIR / "index.html"
    if not index.is_file():
        raise RuntimeError(f"the chat page is missing from the installed package: {index} not found "
                           "(reinstall atlas-vlm; pyproject's package data lists entrypoints/web/static)")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page():
        return FileResponse(index, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
