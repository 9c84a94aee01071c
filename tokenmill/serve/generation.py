"""Running one HTTP request's engine requests: submit, read deltas, abort on disconnect, stream SSE."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.core.request import RequestSLO
from tokenmill.engine.async_engine import AsyncLLMEngine, RequestDelta
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import PositionLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.serve.errors import APIError
from tokenmill.serve.protocol import PromptTokensDetails, Usage

DONE = "data: [DONE]\n\n"
ADMIT_SLICE_S = 0.005  # Submission.start holds the event loop at most about this long at a time


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def error_from_delta(delta: RequestDelta) -> APIError:
    e = delta.error
    return APIError(e.status, e.message, None, e.code,
                    headers={"Retry-After": "1"} if e.status == 503 else None)


@dataclass
class ChoiceState:
    """Everything one choice (one sequence of one prompt) has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def full_text(self) -> str:
        return "".join(self.text)


@dataclass
class PromptState:
    token_ids: list[int]
    text: str | None
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    embedding: list[float] | None = None  # an embedding request's vector (serve/embeddings.py)


class Submission:
    """The engine requests behind one HTTP request (one per prompt), all reporting to one asyncio queue.

    Choice i of prompt p is choice number p * n + i in the response, as OpenAI numbers them.
    """

    def __init__(self, engine: AsyncLLMEngine, prompts: list[list[int]], texts: list[str | None],
                 params: list[SamplingParams], priority: int = 0, arrival_time: float | None = None,
                 lora_request: LoRARequest | None = None, slo: RequestSLO | None = None,
                 cache_salt: str | None = None) -> None:
        self.engine = engine
        self.cache_salt = cache_salt  # the prefix-cache salt of the caller (serve/cache_salt.py)
        self.slo = slo
        self.lora_request = lora_request
        self.n = params[0].n
        self.prompts = [PromptState(ids, text) for ids, text in zip(prompts, texts)]
        self.params = params
        self.priority = priority
        self.choices = [ChoiceState() for _ in range(len(prompts) * self.n)]
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        base = random_id("req")
        self.request_ids = [f"{base}-{p}" for p in range(len(prompts))]
        # When the HTTP request arrived (time.monotonic()): the server's TTFT and E2E latency start here.
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

    async def start(self) -> None:
        """Add one engine request per prompt. Admitting a batch of many prompts (each checked, then sent to the
        core once per sequence) yields to the event loop every few milliseconds, so /health and other requests'
        streams never wait for all of it."""
        last_yield = time.monotonic()
        try:
            for p, (prompt, params) in enumerate(zip(self.prompts, self.params)):
                self.engine.add_request(self.request_ids[p], prompt.token_ids, params, self.queue, tag=p,
                                        priority=self.priority, arrival_time=self.arrival_time, prompt=prompt.text,
                                        lora_request=self.lora_request, slo=self.slo,
                                        cache_salt=self.cache_salt)
                if time.monotonic() - last_yield > ADMIT_SLICE_S:
                    await asyncio.sleep(0)
                    last_yield = time.monotonic()
        except BaseException:  # cancelled half-way (the client left): nothing already added may run unread
            self.abort()
            raise

    @property
    def finished(self) -> bool:
        return all(p.finished for p in self.prompts)

    def abort(self) -> None:
        for rid, prompt in zip(self.request_ids, self.prompts):
            if not prompt.finished:
                self.engine.abort(rid)

    async def next(self) -> RequestDelta:
        """The next delta, already applied to the choices; raises APIError for an engine error."""
        delta = await self.queue.get()
        prompt = self.prompts[delta.tag]
        prompt.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            prompt.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            prompt.embedding = delta.embedding
        for s in delta.sequences:
            c = self.choices[delta.tag * self.n + s.index]
            if s.text:
                c.text.append(s.text)
            c.token_ids.extend(s.token_ids)
            if s.logprobs:
                c.logprobs.extend(s.logprobs)
            if s.finish_reason is not None:
                c.finish_reason, c.stop_reason = s.finish_reason, s.stop_reason
        if delta.finished:
            prompt.finished = True
        if delta.error is not None:
            raise error_from_delta(delta)
        return delta

    def choice_index(self, delta: RequestDelta, seq_index: int) -> int:
        return delta.tag * self.n + seq_index

    def usage(self) -> Usage:
        """Token counts over all prompts and choices; completion tokens are the tokens returned."""
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(p.num_cached_tokens for p in self.prompts)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def run_to_end(self, request: Request) -> None:
        """Wait for every prompt to finish; a client that goes away aborts the work."""
        watcher = asyncio.create_task(_watch_disconnect(request, self.abort))
        try:
            while not self.finished:
                await self.next()
        finally:
            watcher.cancel()
            self.abort()


async def _watch_disconnect(request: Request, on_disconnect) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class SSEResponse(StreamingResponse):
    """Server-Sent Events whose generator is always closed, so its `finally` aborts unfinished work
    even when the client disconnected while a chunk was being sent."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type=self.media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def token_decoder(tokenizer) -> Callable[[int], str]:
    """Text of a single token id, for logprob entries that lack it. Memoized for one response: logprobs repeat
    the same ids (the top alternatives, n copies of an echoed prompt), at most a vocabulary's worth of calls."""
    cache: dict[int, str] = {}

    def decode(t: int) -> str:
        text = cache.get(t)
        if text is None:
            text = cache[t] = tokenizer.decode([t])
        return text

    return decode


def error_event(e: APIError) -> str:
    return sse(json.dumps(e.body()))
