"""Plain ASGI middleware (no BaseHTTPMiddleware, so streaming and disconnects pass straight through):
bearer-token auth on every route that does work, a request-body size limit and a body-arrival timeout."""
from __future__ import annotations

import asyncio
import hmac
import time

from tokenmill.serve.errors import APIError, BodyTimeout, BodyTooLarge

# Open without the API key, as in vLLM: probes, the version, and the API's own description.
OPEN_PATHS = frozenset({"/health", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})

MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class GuardMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, protect_metrics: bool = False,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._check(scope)
        if error is not None:
            return await error.response()(scope, receive, send)
        await self.app(scope, self._limited(receive), send)

    def _check(self, scope) -> APIError | None:
        if self.expected is not None and scope["path"] not in self.open_paths:
            given = _header(scope, b"authorization")
            if given is None:
                return APIError(401, MISSING_KEY, None, None)
            # Constant time: how much of the key matched must not show in the response time.
            if not hmac.compare_digest(given, self.expected):
                return APIError(401, WRONG_KEY, None, "invalid_api_key")
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
