"""Routes of embeddings (/v1/embeddings)."""
from __future__ import annotations

from fastapi import FastAPI

from tokenmill.serve.state import ServerState


def add_embeddings_routes(app: FastAPI, state: ServerState) -> None:
    pass
