"""Errors the router answers itself, in OpenAI's shape, and the failure that allows a retry on another backend."""
from __future__ import annotations

from starlette.responses import JSONResponse, Response


def error_body(status: int, message: str, code: str | None = None) -> dict:
    etype = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status)


class BackendFailed(Exception):
    """The backend failed before anything reached the client: safe to retry elsewhere."""

    def __init__(self, message: str, response: Response | None = None) -> None:
        super().__init__(message)
        self.response = response  # the backend's own error, to pass on if no retry is possible
