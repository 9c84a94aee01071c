"""The load generator: streams requests to an OpenAI-compatible server over HTTP/1.1 and times
every content chunk.

Timing rules (the metrics are only as good as these):
- `start` is taken just before the request is sent, after any wait for a concurrency slot;
- TTFT is the first chunk whose text (or chat delta content / reasoning) is non-empty;
- every later content chunk adds one inter-token gap; a server that packs several tokens into
  one chunk yields fewer, longer gaps (`chunks` < `output_tokens` in the record shows it);
- the end is when the stream finishes (`[DONE]` or the body ends).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Sequence

import httpx
import numpy as np

from tokenmill.bench.datasets import BenchRequest, Tokenizer, encode
from tokenmill.bench.sse import DONE, SSEDecoder

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def api_root(base_url: str) -> str:
    """`http://host:port`, `http://host:port/` and `http://host:port/v1` all name the same server."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout: float | None = 6 * 3600.0

    @property
    def url(self) -> str:
        return api_root(self.base_url) + ENDPOINT_PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class LoadConfig:
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0          # gamma shape; 1.0 is Poisson
    max_concurrency: int | None = None
    seed: int = 0
    progress: bool = True


@dataclass
class RequestError:
    type: str                 # OpenAI error type, or the exception's class name
    message: str
    status: int | None = None  # HTTP status when the server answered

    @property
    def key(self) -> str:
        """What errors are grouped by in the report."""
        return f"HTTP {self.status} {self.type}" if self.status is not None else self.type


@dataclass
class RequestRecord:
    index: int
    start: float              # seconds since the benchmark started
    end: float
    prompt_len: int           # the dataset's length (tokens with a tokenizer, else words)
    output_len: int | None    # max_tokens requested
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    token_source: str = "usage"  # usage | tokenizer | estimate
    chunks: int = 0              # content chunks received
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens when sent
    error: RequestError | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def e2el(self) -> float:
        return self.end - self.start


class WarmupFailed(ValueError):
    """Every warm-up request failed: the server is down or rejects these requests."""


@dataclass
class BenchmarkRun:
    records: list[RequestRecord]
    started_at: str  # ISO 8601, UTC
    warmup_errors: list[RequestError] = field(default_factory=list)
    metrics_before: str | None = None  # the server's /metrics text after warm-up, before measuring
    metrics_after: str | None = None


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start, the first at 0. Gaps are gamma-distributed with
    shape=burstiness and mean 1/rate (burstiness 1 is a Poisson process; < 1 burstier, > 1 more
    regular); an infinite rate sends everything at once."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def build_payload(cfg: ClientConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        body["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt if req.prompt is not None else "\n".join(
            str(m.get("content", "")) for m in req.messages or [])
    if req.output_len is not None:
        body["max_tokens"] = req.output_len
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    body.update(cfg.extra_body)
    return body


def error_from_body(status: int | None, body: bytes) -> RequestError:
    """OpenAI's {"error": {"type", "message"}}, vLLM's older {"object": "error", ...}, FastAPI's
    {"detail": ...}, or the raw body. `status` is None for an error event inside a 200 stream."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    etype, message = ("StreamError" if status is None else f"HTTP{status}"), text.strip()[:500]
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            etype = str(err.get("type") or err.get("code") or etype)
            message = str(err.get("message", message))
        elif isinstance(err, str):
            message = err
        elif obj.get("object") == "error":
            etype, message = str(obj.get("type") or etype), str(obj.get("message", message))
        elif "detail" in obj:
            message = str(obj["detail"])
    return RequestError(type=etype, message=message, status=status)


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return choice.get("text") or ""


@dataclass
class _Stream:
    """What one response stream has delivered so far."""

    start: float
    stamps: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: RequestError | None = None
    done: bool = False

    def on_event(self, data: str, now: float) -> None:
        if data == DONE:
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = RequestError("InvalidJSON", f"stream event is not JSON: {data[:200]!r}")
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            self.error = error_from_body(None, data.encode())
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        text = "".join(_chunk_text(c) for c in obj.get("choices") or [] if isinstance(c, dict))
        if text:
            self.stamps.append(now)
            self.parts.append(text)


async def _stream_request(client: httpx.AsyncClient, cfg: ClientConfig, body: dict[str, Any], st: _Stream) -> None:
    async with client.stream("POST", cfg.url, json=body, headers=cfg.headers()) as resp:
        if resp.status_code != 200:
            st.error = error_from_body(resp.status_code, await resp.aread())
            return
        dec = SSEDecoder()
        async for line in resp.aiter_lines():
            data = dec.feed(line)
            if data is not None:
                st.on_event(data, time.perf_counter())
                if st.done or st.error:
                    return
        data = dec.flush()
        if data is not None:
            st.on_event(data, time.perf_counter())


async def send_request(client: httpx.AsyncClient, cfg: ClientConfig, req: BenchRequest, index: int,
                       t0: float, tokenizer: Tokenizer | None = None) -> RequestRecord:
    """Send one streaming request; never raises (failures become `record.error`)."""
    body = build_payload(cfg, req)
    st = _Stream(start=time.perf_counter())
    try:
        await asyncio.wait_for(_stream_request(client, cfg, body, st), cfg.request_timeout)
    except asyncio.TimeoutError:
        st.error = RequestError("Timeout", f"no complete response within {cfg.request_timeout} s")
    except Exception as e:  # noqa: BLE001 - every failure is recorded, none is dropped
        st.error = RequestError(type(e).__name__, str(e) or repr(e))
    end = time.perf_counter()
    rec = RequestRecord(index=index, start=st.start - t0, end=end - t0, prompt_len=req.prompt_len,
                        output_len=req.output_len, chunks=len(st.stamps), error=st.error)
    if st.stamps:
        rec.ttft = st.stamps[0] - st.start
        rec.itl = [b - a for a, b in zip(st.stamps, st.stamps[1:])]
    usage = st.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens, rec.token_source = usage["completion_tokens"], "usage"
    elif tokenizer is not None:
        rec.output_tokens, rec.token_source = len(encode(tokenizer, "".join(st.parts))), "tokenizer"
    else:
        rec.output_tokens, rec.token_source = len(st.stamps), "estimate"
    rec.input_tokens = usage["prompt_tokens"] if isinstance(usage.get("prompt_tokens"), int) else req.prompt_len
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]
    return rec


def make_client(max_connections: int | None, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    # No pool or read timeout: a queued request may wait long for its first byte; the per-request
    # deadline is ClientConfig.request_timeout.
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(None, connect=30.0)
    return httpx.AsyncClient(http1=True, http2=False, limits=limits, timeout=timeout, transport=transport)


async def run_requests(client: httpx.AsyncClient, cfg: ClientConfig, requests: list[BenchRequest],
                       load: LoadConfig, tokenizer: Tokenizer | None = None,
                       shaped: bool = True, desc: str = "requests", t0: float | None = None) -> list[RequestRecord]:
    """Send `requests` at the arrival times of `load` (all at once when not `shaped`), at most
    `max_concurrency` in flight; records come back in dataset order. `t0` (time.perf_counter()): when the
    arrival times start (default: now), for several loads that share one clock."""
    offsets = arrival_offsets(len(requests), load.request_rate if shaped else math.inf, load.burstiness, load.seed)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = _progress(len(requests), desc, load.progress)
    t0 = time.perf_counter() if t0 is None else t0

    async def one(i: int, req: BenchRequest) -> RequestRecord:
        async with limit if limit is not None else contextlib.nullcontext():
            rec = await send_request(client, cfg, req, i, t0, tokenizer)
        bar.update(1)
        return rec

    tasks = []
    for i, (req, offset) in enumerate(zip(requests, offsets)):
        delay = t0 + float(offset) - time.perf_counter()  # absolute schedule: no drift
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req)))
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        bar.close()


async def warm_up(client: httpx.AsyncClient, cfg: ClientConfig, warmups: Sequence[BenchRequest], load: LoadConfig,
                  tokenizer: Tokenizer | None = None) -> list[RequestRecord]:
    """Send the warm-up requests all at once (results discarded by the caller); WarmupFailed when every one
    failed, rather than measuring a server that cannot answer."""
    warm = await run_requests(client, cfg, list(warmups), load, tokenizer, shaped=False, desc="warm-up") \
        if warmups else []
    if warm and all(r.error is not None for r in warm):
        e = warm[0].error
        raise WarmupFailed(f"all {len(warm)} warm-up requests to {cfg.url} failed; first: {e.key}: {e.message}")
    return warm


async def run_benchmark(cfg: ClientConfig, requests: list[BenchRequest], load: LoadConfig,
                        warmups: Sequence[BenchRequest] = (), tokenizer: Tokenizer | None = None,
                        transport: httpx.AsyncBaseTransport | None = None,
                        metrics_url: str | None = None) -> BenchmarkRun:
    """Warm up (all at once, results discarded), scrape `metrics_url`, run the measured requests,
    scrape again. Raises WarmupFailed when every warm-up request failed, rather than measuring a
    server that cannot answer."""
    async with make_client(load.max_concurrency, transport) as client:
        warm = await warm_up(client, cfg, warmups, load, tokenizer)
        before = await fetch_text(metrics_url, cfg.api_key, transport=transport) if metrics_url else None
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        records = await run_requests(client, cfg, requests, load, tokenizer)
        after = await fetch_text(metrics_url, cfg.api_key, transport=transport) if metrics_url else None
    return BenchmarkRun(records=records, started_at=started_at, metrics_before=before, metrics_after=after,
                        warmup_errors=[r.error for r in warm if r.error is not None])


async def fetch_text(url: str, api_key: str | None = None, timeout: float = 10.0,
                     transport: httpx.AsyncBaseTransport | None = None) -> str | None:
    """GET a small document (`/metrics`, `/v1/models`); None on any failure."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout, transport=transport) as client:
            resp = await client.get(url, headers=headers)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


async def first_model(base_url: str, api_key: str | None = None,
                      transport: httpx.AsyncBaseTransport | None = None) -> str | None:
    """The first model id the server lists at /v1/models."""
    text = await fetch_text(api_root(base_url) + "/v1/models", api_key, transport=transport)
    try:
        data = json.loads(text or "")["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False)
