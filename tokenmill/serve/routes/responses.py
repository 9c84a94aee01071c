"""Routes of the Responses API (/v1/responses): create (serve/responses/create.py), and retrieve or delete a stored
response (serve/responses/store.py; a tenant sees only its own: another tenant's id is unknown to it)."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.serve.body import parse_body
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.openapi import request_body
from tokenmill.serve.responses.create import create_response, owner_of
from tokenmill.serve.responses.protocol import ResponsesRequest
from tokenmill.serve.responses.store import ResponseStore
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import tenant_of


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "response_id", "not_found")


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    store = ResponseStore()
    app.state.responses = store

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def create(raw: Request):
        arrival = time.monotonic()  # before the body is parsed and the prompt tokenized: both are latency
        return await create_response(state, store, await parse_body(raw, ResponsesRequest), raw, arrival)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, raw: Request, stream: bool = False):
        if stream:
            raise bad_request("stream is not supported when retrieving a response (there are no background "
                              "responses to follow).", "stream")
        entry = store.get(response_id, owner_of(tenant_of(raw.scope)))
        if entry is None:
            raise _not_found(response_id)
        return Response(entry.body, media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, raw: Request):
        if not store.delete(response_id, owner_of(tenant_of(raw.scope))):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
