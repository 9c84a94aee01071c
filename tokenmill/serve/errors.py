"""Every error leaves the server as OpenAI's shape: {"error": {"message", "type", "param", "code"}}, except on the
Anthropic Messages API's paths (/v1/messages...), where it takes Anthropic's: {"type": "error", "error": {"type",
"message"}}. One APIError renders either; `response(path)` picks by the request's path, so the middleware's refusals,
body parsing and every exception handler answer each surface in its own shape."""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

# OpenAI's `type` for each status class.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

# Anthropic's error `type` for each status (its API's error reference); other 4xx are invalid requests, 5xx api errors.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def is_anthropic_path(path: str | None) -> bool:
    """The Anthropic Messages API's routes (and unknown URLs under them) answer errors in Anthropic's shape."""
    return path is not None and (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"))


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's shape: no param or code, a type per status."""
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str | None = None) -> JSONResponse:
        """The answer to a request for `path`: Anthropic's shape on its paths, OpenAI's everywhere else."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one Server-Sent Event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"

    def anthropic_sse(self) -> str:
        """Anthropic's stream error event (its SDK raises it as the status's exception)."""
        return f"event: error\ndata: {json.dumps(self.anthropic_body())}\n\n"


class BodyTooLarge(Exception):
    """Raised while reading a request body that grows past the limit."""


class BodyTimeout(Exception):
    """Raised while reading a request body that does not arrive in time (--request-body-timeout)."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_value_error(e: ValueError, known_params: set[str], default_param: str | None = None) -> APIError:
    """SamplingParams and the engine start their messages with the parameter's name; use it as `param`."""
    message = " ".join(str(e).split()) or "invalid request"
    first = message.split(" ", 1)[0]
    param = first if first in known_params else default_param
    return APIError(400, message, param)


def context_length_error(max_model_len: int, num_prompt: int, max_tokens: int | None, chat: bool) -> APIError:
    """OpenAI's wording for a request that does not fit the context window."""
    what = "messages" if chat else "prompt"
    if max_tokens is None:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
                   f"resulted in {num_prompt} tokens. Please reduce the length of the {what}.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the completion). "
                   f"Please reduce the length of the {what} or completion.")
    return APIError(400, message, what, "context_length_exceeded")
