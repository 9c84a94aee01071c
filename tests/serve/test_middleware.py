"""GuardMiddleware on a bare app: which routes need the key (--protect-metrics), and the body timeout."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tokenmill.serve.errors import BodyTimeout
from tokenmill.serve.middleware import GuardMiddleware

KEY = "sk-mw"


async def echo(request: Request):
    return PlainTextResponse(str(len(await request.body())))


def app(protect_metrics: bool, body_timeout_s: float = 30.0):
    routes = [Route(p, echo, methods=["GET", "POST"]) for p in ("/health", "/metrics", "/tokenize", "/v1/models", "/")]
    return GuardMiddleware(Starlette(routes=routes), api_key=KEY, max_body_bytes=1000, protect_metrics=protect_metrics,
                           body_timeout_s=body_timeout_s)


async def statuses(asgi, headers=None) -> dict[str, int]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(asgi), base_url="http://t") as c:
        return {p: (await c.get(p, headers=headers)).status_code for p in ("/health", "/metrics", "/tokenize",
                                                                           "/v1/models", "/")}


@pytest.mark.parametrize("protect", [False, True])
def test_which_routes_need_the_key(protect):
    without = asyncio.run(statuses(app(protect)))
    assert without == {"/health": 200, "/metrics": 401 if protect else 200, "/tokenize": 401, "/v1/models": 401,
                       "/": 200}  # the web console's page: open, it holds no data (serve/roles.py)
    with_key = asyncio.run(statuses(app(protect), {"Authorization": f"Bearer {KEY}"}))
    assert set(with_key.values()) == {200}


def test_a_body_that_stalls_raises_body_timeout():
    guard = app(False, body_timeout_s=0.05)
    scope = {"type": "http", "method": "POST", "path": "/health", "raw_path": b"/health", "query_string": b"",
             "headers": [], "http_version": "1.1", "scheme": "http", "server": ("t", 80), "root_path": ""}
    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(10)  # the rest never comes

    async def send(message):
        pass

    with pytest.raises(BodyTimeout):
        asyncio.run(asyncio.wait_for(guard(scope, receive, send), 5))
