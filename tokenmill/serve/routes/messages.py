"""Routes of the Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): the work is in serve/anthropic/.
Errors on these paths answer in Anthropic's shape (serve/errors.py picks it by path)."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request

from tokenmill.serve.anthropic.messages import count_tokens, create_message
from tokenmill.serve.anthropic.protocol import CountTokensRequest, MessagesRequest
from tokenmill.serve.body import parse_body
from tokenmill.serve.openapi import request_body
from tokenmill.serve.state import ServerState


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    # anthropic-version and anthropic-beta headers are accepted and ignored: one version of the API is served.
    @app.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
    async def messages(raw: Request):
        arrival = time.monotonic()  # before the body is parsed and the prompt rendered: both are latency
        return await create_message(state, await parse_body(raw, MessagesRequest), raw, arrival)

    @app.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
    async def messages_count_tokens(raw: Request):
        return await count_tokens(state, await parse_body(raw, CountTokensRequest), raw)
