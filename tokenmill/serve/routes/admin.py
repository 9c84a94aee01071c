"""Admin, usage and operations: /v1/usage, /admin/reload, /health, /version, /v1/diagnostics, /metrics (`/` is the
web console's, serve/routes/ui.py)."""
from __future__ import annotations

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from tokenmill import __version__
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.metrics import CONTENT_TYPE
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import reload_keys
from tokenmill.serve.tenants.usage import aread_usage, rows_to_csv
from tokenmill.structured_output.checker import checker_status


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/usage")
    async def usage(raw: Request, tenant: str | None = None, start: str | None = Query(None, alias="from"),
                    to: str | None = None, group_by: str = "tenant,model", format: str = "json"):
        """Metered usage (--usage-db). The admin sees every tenant; a tenant's key sees its own only."""
        if state.usage is None:
            raise APIError(404, "This server keeps no usage (start it with --usage-db).", None, "not_found")
        # Its own reader thread and connection (never the tokenizer's thread), rate-limited per caller.
        rows = await aread_usage(state.usage, raw.scope, tenant, start, to, group_by)
        if format == "csv":
            return Response(rows_to_csv(rows), media_type="text/csv")
        return {"object": "list", "data": rows}

    @app.post("/admin/reload")
    async def admin_reload():
        """Re-read --api-keys-file (the admin key only: the middleware checks it)."""
        if state.keys is None:
            raise APIError(404, "This server has no --api-keys-file to reload.", None, "not_found")
        try:
            return {"tenants": await state.run_blocking(reload_keys, state.keys)}
        except ValueError as e:
            raise bad_request(f"the keys file was not reloaded, the old keys stay: {e}", None) from None

    @app.get("/health")
    async def health():
        if not state.engine.is_alive:
            return APIError(503, "The engine is not running.", None, "engine_dead").response()
        if state.engine.draining:
            return APIError(503, "The server is shutting down.", None, "shutting_down").response()
        # Still 200 while the grammar checker restarts: only grammar requests are refused (503) meanwhile.
        return {"status": "ok", "grammar_worker": checker_status().state}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/diagnostics")
    async def diagnostics(last_n: int | None = None):
        """Where the time went over the recent steps, against this machine's measured peaks."""
        return await state.engine.call("diagnostics", last_n)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)
