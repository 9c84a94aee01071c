"""Routes of the Anthropic Messages API (/v1/messages)."""
from __future__ import annotations

from fastapi import FastAPI

from tokenmill.serve.state import ServerState


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    pass
