"""/openapi.json describes every route's request body: routes parse their own bodies (serve/body.py), so each
names its model (serve/openapi.py) and the schema must carry it, with every $ref resolving."""
from __future__ import annotations

from pathlib import Path
import asyncio

import pytest

from tokenmill.serve.anthropic.protocol import MessagesRequest
from tokenmill.serve.protocol import ChatCompletionRequest
from tokenmill.serve.responses.protocol import ResponsesRequest

BODYLESS = {"/admin/reload"}  # POST routes that take no body


@pytest.fixture(scope="module")
def schema():
    import httpx

    from tokenmill.serve.app import build_app
    from tokenmill.serve.metrics import ServerMetrics
    from tokenmill.serve.state import ServerSettings, ServerState

    class Engine:  # the schema needs no model: the app is built, never started
        is_alive, draining = True, False

    state = ServerState(Engine(), ServerSettings(served_model_names=["m"]), ServerMetrics("m"))

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(state)), base_url="http://t") as c:
            return await c.get("/openapi.json")

    try:
        r = asyncio.run(get())
    finally:
        state.shutdown()
    assert r.status_code == 200, r.text
    return r.json()


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_every_post_route_has_a_request_body(schema):
    posts = {path: ops["post"] for path, ops in schema["paths"].items() if "post" in ops}
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings"} <= set(posts)
    for path, op in posts.items():
        if path in BODYLESS:
            continue
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        assert body is not None, path


def test_every_ref_resolves_and_models_are_complete(schema):
    components = schema["components"]["schemas"]
    for ref in set(_refs(schema)):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in components, ref
    for model in (ChatCompletionRequest, ResponsesRequest, MessagesRequest):
        fields = components[model.__name__]["properties"]
        assert set(model.model_fields) <= set(fields) | {n for n, f in model.model_fields.items() if f.alias}, \
            model.__name__


def test_docs_api_lists_every_route():
    """docs/api.md's route table names every route of the role table (serve/roles.py) with its role."""
    import re
    from pathlib import Path

    from tokenmill.serve.roles import ROUTES

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for path, role in ROUTES.items():
        if path == "/docs/oauth2-redirect":  # FastAPI's own helper page for /docs
            continue
        row = next((r for r in rows if re.search(f"`{re.escape(path)}`", r)), None)
        assert row is not None, f"docs/api.md has no row for {path}"
        assert f"| {role.value} |" in row, (path, role.value, row)
