"""Plain ASGI middleware (no BaseHTTPMiddleware, so streaming and disconnects pass straight through):
bearer-token auth on every route that does work (one --api-key, or the tenants of --api-keys-file, whose
tenant the route handlers find in `request.state.tenant`), the tenants' admission limits on the generating
routes, the admin key on /admin, a request-body size limit and a body-arrival timeout."""
from __future__ import annotations

import asyncio
import hmac
import time

from tokenmill.serve.errors import APIError, BodyTimeout, BodyTooLarge
from tokenmill.serve.tenants.counters import TenantCounters
from tokenmill.serve.tenants.keys import KeyStore, Tenant
from tokenmill.serve.tenants.limits import TenantLimiter
from tokenmill.serve.tenants.usage import UsageStore

# Open without the API key, as in vLLM: probes, the version, and the API's own description.
OPEN_PATHS = frozenset({"/health", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."
# The routes that run the model: a tenant's limits apply to these.
GENERATING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
ADMIN_PREFIX = "/admin/"
# The single --api-key's tenant when a keys file is given too: every model, no limits.
DEFAULT_TENANT = Tenant("default")


def _counts(state: dict) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of a request: from its Submission (the server), or from the `metered`
    callable its handler left (the router, from the backend's usage); zeros for a request refused before."""
    sub = state.get("submission")
    if sub is not None:
        u = sub.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        return u.prompt_tokens, cached or 0, u.completion_tokens
    metered = state.get("metered")
    return metered() if metered is not None else (0, 0, 0)


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, protect_metrics: bool = False,
                 body_timeout_s: float = 30.0, keys: KeyStore | None = None, admin_key: str | None = None,
                 limiter: TenantLimiter | None = None, usage: UsageStore | None = None,
                 counters: TenantCounters | None = None) -> None:
        self.app = app
        self.usage = usage
        self.counters = counters
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.keys = keys
        self.admin = f"Bearer {admin_key}".encode() if admin_key else None
        self.limiter = limiter or TenantLimiter()
        self.max_body_bytes = max_body_bytes
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error, tenant = self._check(scope)
        generating = scope["path"] in GENERATING_PATHS
        admitted = False
        if error is None and tenant is not None and generating:
            error = self.limiter.admit(tenant)
            admitted = error is None
        if error is not None:
            if generating and tenant is not None:
                self._meter(scope, tenant, error.status)
            return await error.response()(scope, receive, send)
        if not generating or (tenant is None and self.usage is None):
            return await self.app(scope, self._limited(receive), send)
        status = [None]

        async def watched(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, self._limited(receive), watched)
        finally:  # the response is complete (a stream's last byte sent) or the client left
            if admitted:
                self.limiter.release(tenant)
            reservation = scope.get("state", {}).get("reservation")
            if reservation is not None:
                self.limiter.settle(reservation)
            self._meter(scope, tenant, status[0])

    def _meter(self, scope, tenant: Tenant | None, status: int | None) -> None:
        """One finished generating request into the usage store and the tenant's counters: the tokens its
        Submission produced (what was sent, also for a stream cut short), and an error kind for a 4xx/5xx answer."""
        if self.usage is None and (self.counters is None or tenant is None):
            return
        state = scope.get("state", {})
        prompt, cached, completion = _counts(state)
        error = None if status is None or status < 400 else f"http_{status}"
        name = tenant.name if tenant is not None else DEFAULT_TENANT.name
        if self.usage is not None:
            self.usage.record(name, state.get("model", "-"), prompt, cached, completion, error)
        if self.counters is not None and tenant is not None:
            self.counters.record(name, prompt, cached, completion, error)

    def _authenticate(self, scope) -> tuple[APIError | None, Tenant | None]:
        """Who is asking: (None, None) for no one in particular (an open path, no keys configured, the admin or
        the single --api-key without a keys file), (None, tenant), or (the error to answer with, None)."""
        path = scope["path"]
        if path in self.open_paths:
            return None, None
        given = _header(scope, b"authorization")
        # Constant time: how much of a key matched must not show in the response time.
        is_admin = given is not None and self.admin is not None and hmac.compare_digest(given, self.admin)
        if path.startswith(ADMIN_PREFIX):
            if is_admin:
                scope.setdefault("state", {})["admin"] = True
                return None, None
            return APIError(403, "This route needs the admin key (--admin-key).", None, "permission_denied"), None
        if self.expected is None and self.keys is None:
            return None, None
        if given is None:
            return APIError(401, MISSING_KEY, None, None), None
        if is_admin:
            scope.setdefault("state", {})["admin"] = True
            return None, None
        if self.expected is not None and hmac.compare_digest(given, self.expected):
            return None, DEFAULT_TENANT if self.keys is not None else None
        if self.keys is not None and given.startswith(b"Bearer "):
            tenant = self.keys.lookup(given[len(b"Bearer "):].decode("utf-8", "replace"))
            if tenant is not None:
                return None, tenant
        return APIError(401, WRONG_KEY, None, "invalid_api_key"), None

    def _check(self, scope) -> tuple[APIError | None, Tenant | None]:
        error, tenant = self._authenticate(scope)
        if error is not None:
            return error, None
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
        return self._check_length(scope), tenant

    def _check_length(self, scope) -> APIError | None:
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return APIError(400, "Invalid Content-Length header.", None, "invalid_content_length")
            if n > self.max_body_bytes:
                return too_large(self.max_body_bytes)
        return None

    def _limited(self, receive):
        """The body, counted (a chunked upload without Content-Length can be too large too) and timed: it must
        arrive in full within body_timeout_s of the request's start. Later receives (waiting for a disconnect
        while streaming) are not timed."""
        received = 0
        limit = self.max_body_bytes
        deadline = time.monotonic() + self.body_timeout_s
        done = False

        async def wrapped():
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                raise BodyTimeout() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge()
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return wrapped


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {limit} bytes.", None,
                    "request_too_large")
