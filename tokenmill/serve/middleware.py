"""Plain ASGI middleware (no BaseHTTPMiddleware, so streaming and disconnects pass straight through):
bearer-token auth (or Anthropic's x-api-key header) on every route that does work (one --api-key, or the tenants of
--api-keys-file, whose tenant the route handlers find in `request.state.tenant`), the tenants' admission limits on
the generating routes, the admin key on /admin, a request-body size limit and a body-arrival timeout. Refusals
answer in the shape of the surface asked (APIError.response by path)."""
from __future__ import annotations

import asyncio
import hmac
import time

from tokenmill.serve.errors import APIError, BodyTimeout, BodyTooLarge
from tokenmill.serve.roles import Role, caller_may, route_role
from tokenmill.serve.tenants.counters import TenantCounters
from tokenmill.serve.tenants.keys import KeyStore, Tenant
from tokenmill.serve.tenants.limits import TenantLimiter
from tokenmill.serve.tenants.usage import UsageStore

# Open without the API key, as in vLLM: probes, the version, and the API's own description.
OPEN_PATHS = frozenset({"/health", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an x-api-key header.")
WRONG_KEY = "Incorrect API key provided."
# The routes that run the model: a tenant's limits apply to these.
GENERATING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                              "/v1/embeddings"})
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


def _given_key(scope) -> bytes | None:
    """The key as `Bearer KEY`: from the Authorization header (OpenAI's clients), else from x-api-key (Anthropic's
    clients send the key there). The same keys, tenants and roles hold either way."""
    given = _header(scope, b"authorization")
    if given is None:
        key = _header(scope, b"x-api-key")
        given = b"Bearer " + key if key is not None else None
    return given


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, protect_metrics: bool = False,
                 body_timeout_s: float = 30.0, keys: KeyStore | None = None, admin_key: str | None = None,
                 limiter: TenantLimiter | None = None, usage: UsageStore | None = None,
                 counters: TenantCounters | None = None, internal_key: str | None = None) -> None:
        self.app = app
        self.usage = usage
        self.counters = counters
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.keys = keys
        self.admin = f"Bearer {admin_key}".encode() if admin_key else None
        self.internal = f"Bearer {internal_key}".encode() if internal_key else None
        # Roles hold once any key beyond the single --api-key exists; without, every route but /admin is as open
        # as the --api-key (or no key) makes it, as before roles existed.
        self.roles = keys is not None or self.admin is not None or self.internal is not None
        self.limiter = limiter or TenantLimiter()
        self.max_body_bytes = max_body_bytes
        # /metrics names the tenants and their usage: open only without a keys file and --protect-metrics.
        self.open_paths = OPEN_PATHS if protect_metrics or keys is not None else OPEN_PATHS | {"/metrics"}
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error, tenant = self._check(scope)
        generating = scope["path"] in GENERATING_PATHS
        admitted = False
        if error is None and tenant is not None and generating:
            error = self.limiter.admit(tenant)  # one sequence; the handler takes the rest (admit_sequences)
            admitted = error is None
            if admitted:
                scope.setdefault("state", {})["sequences"] = 1
        if error is not None:
            if generating and tenant is not None:
                self._meter(scope, tenant, error.status)
            return await error.response(scope["path"])(scope, receive, send)
        if not generating or (tenant is None and self.usage is None):
            try:
                return await self.app(scope, self._limited(receive), send)
            finally:
                run_cleanups(scope)
        status = [None]

        async def watched(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, self._limited(receive), watched)
        finally:  # the response is complete (a stream's last byte sent) or the client left
            run_cleanups(scope)
            if admitted:
                self.limiter.release(tenant, scope["state"]["sequences"])
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

    def _caller(self, given: bytes | None) -> Role | None:
        """ADMIN or INTERNAL for those keys (compared in constant time: how much of a key matched must not show
        in the response time), else None."""
        if given is None:
            return None
        if self.admin is not None and hmac.compare_digest(given, self.admin):
            return Role.ADMIN
        if self.internal is not None and hmac.compare_digest(given, self.internal):
            return Role.INTERNAL
        return None

    def _authenticate(self, scope) -> tuple[APIError | None, Tenant | None]:
        """Who is asking, and may they call this route (serve/roles.py): (None, None) for a caller without a
        tenant (an open route, no keys configured, the admin or internal key, the single --api-key without a
        keys file), (None, tenant), or (the error to answer with, None)."""
        path = scope["path"]
        route = route_role(path)
        if route is Role.OPEN or path in self.open_paths:
            return None, None
        given = _given_key(scope)
        caller = self._caller(given)
        if caller is not None:
            state = scope.setdefault("state", {})
            state["role"] = caller
            state["admin"] = caller is Role.ADMIN
            return (None, None) if caller_may(caller, route) else (_denied(route), None)
        if route is Role.ADMIN and (self.roles or path.startswith(ADMIN_PREFIX)):
            return _denied(route), None
        if self.expected is None and self.keys is None:
            # No tenant keys: tenant routes are open; so is the rest without any roles at all (as before roles).
            return (None, None) if route is Role.TENANT or not self.roles else (_denied(route), None)
        if given is None:
            return APIError(401, MISSING_KEY, None, None), None
        tenant, known = None, False
        if self.expected is not None and hmac.compare_digest(given, self.expected):
            tenant, known = (DEFAULT_TENANT if self.keys is not None else None), True
        elif self.keys is not None and given.startswith(b"Bearer "):
            tenant = self.keys.lookup(given[len(b"Bearer "):].decode("utf-8", "replace"))
            known = tenant is not None
        if not known:
            return APIError(401, WRONG_KEY, None, "invalid_api_key"), None
        if route is not Role.TENANT and self.roles:
            return _denied(route), None
        scope.setdefault("state", {})["role"] = Role.TENANT
        return None, tenant

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


def on_response_done(scope, fn) -> None:
    """Call fn() once the response is complete or the client left (a handler's resources held for a stream)."""
    scope.setdefault("state", {}).setdefault("cleanups", []).append(fn)


def run_cleanups(scope) -> None:
    for fn in scope.get("state", {}).pop("cleanups", ()):
        fn()


def _denied(route: Role) -> APIError:
    if route is Role.ADMIN:
        return APIError(403, "This route needs the admin key (--admin-key).", None, "permission_denied")
    return APIError(403, "This route is for internal callers (--internal-api-key or the admin key).", None,
                    "permission_denied")


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {limit} bytes.", None,
                    "request_too_large")
