"""The web console (docs/console.md): `GET /` and `/ui/{file}` serve the static single-page app shipped in
tokenmill/serve/ui/static. The page holds no data, so these routes are open (serve/roles.py); every number it
shows comes from the /v1 routes with the key the user typed, so a key sees in the page exactly what it may read
through the API. `GET /` answers JSON to API clients (an Accept header without text/html), as it always did."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from tokenmill import __version__
from tokenmill.bench.report import ROWS
from tokenmill.serve.errors import APIError
from tokenmill.serve.state import ServerState

STATIC = Path(__file__).resolve().parent.parent / "ui" / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# The page may talk to this server only: no CDN, no fetch elsewhere, no inline script, not framed.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data: blob:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def static_files() -> dict[str, Path]:
    """The files the console serves, by name (a fixed set: no path from the URL ever reaches the filesystem)."""
    return {p.name: p for p in sorted(STATIC.iterdir()) if p.is_file() and p.suffix in TYPES}


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def add_ui_routes(app: FastAPI, state: ServerState) -> None:
    enabled = state.settings.ui
    files = static_files() if enabled else {}
    # The old `/` answer for API clients. Model names only where `/` was open before (no key configured at all):
    # with keys they are behind /v1/models, which lists what each key may use.
    open_server = not (state.settings.api_key or state.keys or state.settings.admin_key
                       or state.settings.internal_api_key)

    @app.get("/", include_in_schema=False)
    async def root(request: Request):
        if enabled and wants_html(request):
            return FileResponse(files["index.html"], media_type=TYPES[".html"], headers=HEADERS)
        body = {"name": "tokenmill", "version": __version__}
        if open_server:
            body["models"] = state.settings.served_model_names
        if enabled:
            body["console"] = "/ui/"
        return JSONResponse(body)

    if not enabled:
        return

    @app.get("/ui", include_in_schema=False)
    @app.get("/ui/", include_in_schema=False)
    async def ui_index():
        return FileResponse(files["index.html"], media_type=TYPES[".html"], headers=HEADERS)

    @app.get("/ui/bench-rows.json", include_in_schema=False)
    async def bench_rows():
        # The bench report's summary rows (tokenmill/bench/report.py), so the Bench page shows the same table.
        return JSONResponse([{"label": label, "path": path, "digits": digits} for label, path, digits in ROWS],
                            headers=HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    async def ui_file(name: str):
        path = files.get(name)
        if path is None:
            raise APIError(404, f"Unknown request URL: GET /ui/{name}. Please check the URL for typos.", None,
                           "unknown_url")
        return FileResponse(path, media_type=TYPES[path.suffix], headers=HEADERS)

