"""The FastAPI app: OpenAI-compatible routes over an AsyncLLMEngine (serve/routes/, one module per surface),
errors always in OpenAI's shape (Anthropic's on /v1/messages: APIError.response picks by path), request bodies
parsed by serve/body.py."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.engine.output import EngineError
from tokenmill.serve.body import validation_error
from tokenmill.serve.errors import APIError, BodyTimeout, BodyTooLarge
from tokenmill.serve.middleware import GuardMiddleware, too_large
from tokenmill.serve.openapi import install as install_openapi
from tokenmill.serve.routes.admin import add_admin_routes
from tokenmill.serve.routes.embeddings import add_embeddings_routes
from tokenmill.serve.routes.generation import add_generation_routes
from tokenmill.serve.routes.internal_kv import add_internal_kv_routes
from tokenmill.serve.routes.messages import add_messages_routes
from tokenmill.serve.routes.models import add_model_routes, register_lora_modules
from tokenmill.serve.routes.responses import add_responses_routes
from tokenmill.serve.routes.tenant_status import add_tenant_status_routes
from tokenmill.serve.routes.ui import add_ui_routes
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import reload_on_sighup

log = logging.getLogger(__name__)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        if state.keys is not None:
            reload_on_sighup(state.keys)
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)
        state.shutdown()

    register_lora_modules(state)
    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.tokenmill = state
    _add_error_handlers(app)
    _add_routes(app, state)
    install_openapi(app)
    settings = state.settings
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_request_body_bytes,
                       protect_metrics=settings.protect_metrics, body_timeout_s=settings.request_body_timeout_s,
                       keys=state.keys, admin_key=settings.admin_key, limiter=state.limiter, usage=state.usage,
                       counters=state.metrics.tenants, internal_key=settings.internal_api_key)
    return app


def _path(request: Request) -> str:
    """The route's path (without a root path): the error's shape follows the surface asked."""
    return request.scope["path"]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response(_path(request))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge):
        return too_large(app.state.tokenmill.settings.max_request_body_bytes).response(_path(request))

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, e: BodyTimeout):
        limit = app.state.tokenmill.settings.request_body_timeout_s
        return APIError(408, f"The request body did not arrive within {limit:g} s.", None, "request_timeout",
                        headers={"Connection": "close"}).response(_path(request))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return validation_error(e.errors()).response(_path(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}. Please check the URL for typos."
            return APIError(404, message, None, "unknown_url").response(_path(request))
        if e.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}."
            return APIError(405, message, None, "method_not_allowed").response(_path(request))
        return APIError(e.status_code, str(e.detail), None, None).response(_path(request))

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError):  # engine.call: e.g. 503 engine_dead
        return APIError(e.status, e.message, None, e.code,
                        headers={"Retry-After": "1"} if e.status == 503 else None).response(_path(request))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"Internal server error: {type(e).__name__}", None, "internal_error"
                        ).response(_path(request))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    add_generation_routes(app, state)
    add_responses_routes(app, state)
    add_messages_routes(app, state)
    add_embeddings_routes(app, state)
    add_model_routes(app, state)
    add_admin_routes(app, state)
    add_internal_kv_routes(app, state)
    add_tenant_status_routes(app, state)
    add_ui_routes(app, state)
