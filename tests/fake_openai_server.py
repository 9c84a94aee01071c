"""A tiny OpenAI-compatible streaming server for the bench tests: known delays, known usage,
errors on request. Prompts starting with FAIL400 / FAIL500 / FAILSTREAM fail in that way; BREAKSTREAM
drops the connection after the first chunk. Router tests: `healthy` (GET /health), `fail_status`, `honor_stream`."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeConfig:
    ttft_s: float = 0.1           # delay before the first content chunk
    itl_s: float = 0.03           # delay between content chunks
    tokens_per_chunk: int = 1
    send_usage: bool = True
    api_key: str | None = None
    model: str = "fake-model"
    requests_seen: list[dict] = field(default_factory=list)
    keys_seen: list[str | None] = field(default_factory=list)  # the Authorization header of each request
    counters: dict[str, float] = field(default_factory=lambda: {"queries": 0.0, "hits": 0.0, "preemptions": 0.0})
    ttft_observed: list[float] = field(default_factory=list)
    healthy: bool = True          # GET /health: 200, else 503
    fail_status: int | None = None  # every completion answers this status before any byte
    honor_stream: bool = False    # "stream": false gets one JSON body (default: always SSE)


def _error(status: int, etype: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": None, "code": status}}, status)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(cfg: FakeConfig) -> Starlette:
    async def completions(request: Request):
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return _error(401, "AuthenticationError", "bad api key")
        body = await request.json()
        cfg.requests_seen.append(body)
        cfg.keys_seen.append(request.headers.get("authorization"))
        if cfg.fail_status is not None:
            return _error(cfg.fail_status, "ServiceUnavailableError", "backend refused")
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt.startswith("FAIL400"):
            return _error(400, "BadRequestError", "prompt is too long")
        if prompt.startswith("FAIL500"):
            return _error(500, "InternalServerError", "engine fell over")
        n_tokens = int(body.get("max_tokens") or 4)
        n_prompt = len(prompt.split())
        cfg.counters["queries"] += n_prompt
        cfg.counters["hits"] += n_prompt // 2

        async def stream():
            start = time.perf_counter()
            if chat:  # OpenAI opens a chat stream with an empty role delta: not a token
                yield _sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(cfg.ttft_s)
            sent = 0
            while sent < n_tokens:
                k = min(cfg.tokens_per_chunk, n_tokens - sent)
                if sent:
                    await asyncio.sleep(cfg.itl_s)
                else:
                    cfg.ttft_observed.append(time.perf_counter() - start)
                text = " tok" * k
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield _sse({"object": "chunk", "choices": [choice]})
                sent += k
                if prompt.startswith("BREAKSTREAM"):
                    raise RuntimeError("connection dropped mid-stream")
                if prompt.startswith("FAILSTREAM"):
                    yield _sse({"error": {"type": "EngineDeadError", "message": "died mid-stream"}})
                    return
            yield _sse({"object": "chunk", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if cfg.send_usage:
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n_tokens, "total_tokens": n_prompt + n_tokens,
                         "prompt_tokens_details": {"cached_tokens": n_prompt // 2}}
                yield _sse({"object": "chunk", "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        if cfg.honor_stream and not body.get("stream") and not prompt.startswith(("FAILSTREAM", "BREAKSTREAM")):
            text = " tok" * n_tokens
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({"object": "chat.completion" if chat else "text_completion", "model": cfg.model,
                                 "choices": [choice],
                                 "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_tokens,
                                           "total_tokens": n_prompt + n_tokens}})
        return StreamingResponse(stream(), media_type="text/event-stream")

    async def health(request: Request):
        return PlainTextResponse("", 200 if cfg.healthy else 503)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": cfg.model, "object": "model"}]})

    async def metrics(request: Request):
        c = cfg.counters
        text = (
            "# HELP tokenmill:prefix_cache_queries_total Prefix cache queries in tokens.\n"
            "# TYPE tokenmill:prefix_cache_queries_total counter\n"
            f'tokenmill:prefix_cache_queries_total{{model_name="{cfg.model}"}} {c["queries"]}\n'
            f'tokenmill:prefix_cache_hits_total{{model_name="{cfg.model}"}} {c["hits"]}\n'
            f'tokenmill:num_preemptions_total{{model_name="{cfg.model}"}} {c["preemptions"]}\n'
        )
        return PlainTextResponse(text)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", metrics),
    ])


class FakeServer:
    """Serves make_app(cfg) on a free localhost port in a background thread."""

    def __init__(self, cfg: FakeConfig, port: int = 0) -> None:
        self.cfg = cfg
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(make_app(cfg), log_level="warning", lifespan="off", backlog=256)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
