"""Routes of the Responses API (/v1/responses)."""
from __future__ import annotations

from fastapi import FastAPI

from tokenmill.serve.state import ServerState


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    pass
