"""The router's HTTP face: its routes (completions and chat proxied by router/proxy.py; models, health, metrics,
usage, key reload) and the app's lifespan (the backends' client, health checks and cache-event polling)."""
from __future__ import annotations

import asyncio
import contextlib

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill.router.config import RouterConfig
from tokenmill.router.errors import error_response
from tokenmill.router.metrics import CONTENT_TYPE
from tokenmill.router.proxy import Router
from tokenmill.serve.errors import APIError
from tokenmill.serve.middleware import GuardMiddleware
from tokenmill.serve.tenants.keys import reload_keys, reload_on_sighup
from tokenmill.serve.tenants.usage import read_usage, rows_to_csv

__all__ = ["RouterConfig", "create_app"]


def create_app(cfg: RouterConfig) -> Starlette:
    router = Router(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        timeout = httpx.Timeout(connect=cfg.connect_timeout_s, read=cfg.read_timeout_s, write=30.0, pool=30.0)
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            router.client = client
            if router.keys is not None:
                reload_on_sighup(router.keys)
            await router.check_all()
            tasks = [asyncio.create_task(router.health_forever())]
            if router.policy.uses_cache:
                tasks.append(asyncio.create_task(router.cache.poll_forever(client, cfg.poll_interval_s)))
            try:
                yield
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if router.usage is not None:
                    await asyncio.to_thread(router.usage.close)  # the last metered requests reach the file

    async def completions(request: Request) -> Response:
        return await router.proxy(request, "/v1/completions")

    async def chat(request: Request) -> Response:
        return await router.proxy(request, "/v1/chat/completions")

    async def health(request: Request) -> Response:
        if router.healthy():
            return Response(status_code=200)
        return error_response(503, "no healthy backend.", "no_healthy_backend")

    async def metrics(request: Request) -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    async def usage(request: Request) -> Response:
        if router.usage is None:
            return error_response(404, "This router keeps no usage (start it with --usage-db).", "not_found")
        q = request.query_params
        try:
            rows = await asyncio.to_thread(read_usage, router.usage, request.scope, q.get("tenant"), q.get("from"),
                                           q.get("to"), q.get("group_by", "tenant,model"))
        except APIError as e:
            return e.response()
        if q.get("format") == "csv":
            return Response(rows_to_csv(rows), media_type="text/csv")
        return JSONResponse({"object": "list", "data": rows})

    async def admin_reload(request: Request) -> Response:
        if router.keys is None:
            return error_response(404, "This router has no --api-keys-file to reload.", "not_found")
        try:
            return JSONResponse({"tenants": await asyncio.to_thread(reload_keys, router.keys)})
        except ValueError as e:
            return error_response(400, f"the keys file was not reloaded, the old keys stay: {e}")

    app = Starlette(lifespan=lifespan, routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/usage", usage, methods=["GET"]),
        Route("/admin/reload", admin_reload, methods=["POST"]),
    ])
    app.state.router = router
    if router.keys is not None or router.usage is not None or cfg.admin_key:
        app.add_middleware(GuardMiddleware, api_key=None, max_body_bytes=cfg.max_request_body_bytes,
                           keys=router.keys, admin_key=cfg.admin_key, limiter=router.limiter, usage=router.usage,
                           counters=router.tenant_counters, internal_key=cfg.internal_api_key)
    return app
