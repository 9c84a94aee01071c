"""Routes of embeddings (/v1/embeddings)."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request

from tokenmill.serve.body import parse_body
from tokenmill.serve.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from tokenmill.serve.openapi import request_body
from tokenmill.serve.state import ServerState


def add_embeddings_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, openapi_extra=request_body(EmbeddingRequest))
    async def embeddings(raw: Request):
        arrival = time.monotonic()  # before the body is parsed and the inputs tokenized: both are latency
        return await create_embedding(state, await parse_body(raw, EmbeddingRequest), raw, arrival)
