"""Internal KV routes, for other tokenmill processes: prefix-cache events for a cache-aware router and a KV
producer's blocks for a decode instance on another node."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.openapi import request_body
from tokenmill.serve.state import ServerState


class KVBlocksRequest(BaseModel):
    """The body of /v1/kv_blocks, for the schema (the route reads it itself: its answer is bytes, not JSON)."""

    hashes: list[str]  # a hash chain's block hashes, hex, in order


def add_internal_kv_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/kv_events")
    async def kv_events(since: int = 0):
        """Prefix-cache blocks stored/removed after event `since`: for a cache-aware router (tokenmill router)."""
        return await state.engine.call("kv_events", since)

    @app.post("/v1/kv_blocks", openapi_extra=request_body(KVBlocksRequest))
    async def kv_blocks(raw: Request):
        """A KV producer's blocks for a decode instance on another node (TCPConnector): the leading blocks of
        the given hash chain that this instance wrote, length-prefixed."""
        from tokenmill.core.kv_connector import read_blocks

        if state.settings.kv_store is None:
            return APIError(404, "this server is not a KV producer (--kv-transfer-config kv_role).", None,
                            "not_found").response()
        try:
            body = json.loads(await raw.body())
            hashes = body["hashes"]
            if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise bad_request("give {\"hashes\": [hex, ...]}.", "hashes") from None
        data = await state.run_blocking(read_blocks, state.settings.kv_store, hashes)
        return Response(data, media_type="application/octet-stream")
