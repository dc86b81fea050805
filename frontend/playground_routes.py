"""The built-in playground page: `GET /` and its assets under `/playground/`.

The page is plain files in the package (frontend/playground/: HTML, CSS and
two hand-written scripts; no CDN, no build step). It is open like /health:
the page itself holds no data, and it asks for the API key before calling
/v1 when the server has one. `--disable-playground` leaves both routes out.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

ASSETS = Path(__file__).resolve().parent / "playground"
ASSET_PREFIX = "/playground"

# Only the page's own files may run or load: an injected tag could neither run
# inline script nor send anything elsewhere (the Markdown renderer escapes too).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def add_playground(app: FastAPI) -> None:
    """Serve the page at `/` and its files at `/playground/...`."""
    index = ASSETS / "index.html"
    if not index.is_file():
        raise FileNotFoundError(f"the playground's files are missing from the package: {index}")

    @app.get("/", include_in_schema=False)
    async def playground_page() -> FileResponse:
        return FileResponse(index, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    app.mount(ASSET_PREFIX, StaticFiles(directory=ASSETS), name="playground")
