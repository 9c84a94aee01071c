"""The router's HTTP face: OpenAI-compatible routes proxied to one backend per request (httpx), with health
checks, one retry on another backend for failures the client never saw, and SSE passed through as it comes.

Retry only before the first byte reaches the client: after that a retry could duplicate a completion, so a
broken stream ends with an error event in OpenAI's shape and `data: [DONE]` instead."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenmill.router.cache_index import CacheIndex, prompt_hashes
from tokenmill.router.config import RouterConfig
from tokenmill.router.errors import BackendFailed, error_body, error_response
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import Policy, make_policy
from tokenmill.router.prompts import (PromptTokenizer, estimate_tokens, prompt_count, requested_max_tokens,
                                     reserved_prompt, sequences_per_prompt, worst_case)
from tokenmill.router.tenants import StreamMeter, apply_tenant, ask_for_usage, metered_stream
from tokenmill.serve.errors import APIError
from tokenmill.serve.tenants.counters import TenantCounters
from tokenmill.serve.tenants.keys import KeyStore, Tenant, tenant_of
from tokenmill.serve.tenants.limits import TenantLimiter, admit_sequences, reserve_for
from tokenmill.serve.tenants.usage import UsageStore, load_pricing

log = logging.getLogger(__name__)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
_FORWARD_HEADERS = ("authorization", "content-type", "accept", "openai-organization", "x-request-id")


@dataclass
class Backend:
    url: str
    healthy: bool = True
    load: int = 0  # outstanding tokens
    in_flight: int = 0


@dataclass
class Router:
    cfg: RouterConfig
    policy: Policy = field(init=False)
    backends: dict[str, Backend] = field(init=False)
    cache: CacheIndex = field(init=False)
    metrics: RouterMetrics = field(init=False)
    prompts: PromptTokenizer = field(init=False)
    client: httpx.AsyncClient | None = None

    def __post_init__(self) -> None:
        urls = [u.rstrip("/") for u in self.cfg.backends]
        if not urls:
            raise ValueError("give at least one --backend URL.")
        self.policy = make_policy(self.cfg.policy)
        self.backends = {u: Backend(u) for u in urls}
        # /v1/kv_events is for internal callers: the router polls with its backend key (the backends' internal key).
        self.cache = CacheIndex(urls, {"authorization": f"Bearer {self.cfg.backend_api_key}"}
                                if self.cfg.backend_api_key else None)
        self.metrics = RouterMetrics(urls)
        self.prompts = PromptTokenizer(self.cfg.tokenizer)
        for u in urls:
            self.metrics.healthy.labels(backend=u).set(1)
        self.prefill = [u.rstrip("/") for u in self.cfg.prefill]
        self._prefill_turn = 0
        self.keys = KeyStore(self.cfg.api_keys_file) if self.cfg.api_keys_file else None
        self.usage = UsageStore(self.cfg.usage_db, load_pricing(self.cfg.pricing) if self.cfg.pricing else None) \
            if self.cfg.usage_db else None
        self.limiter = TenantLimiter()
        # backend -> {model: max_model_len} from its /v1/models: what a request without max_tokens may use.
        self.model_lens: dict[str, dict[str, int]] = {}
        self.tenant_counters = TenantCounters(self.metrics.registry, "tokenmill:router_", {})

    # ---- health --------------------------------------------------------------------------
    def healthy(self) -> list[str]:
        return [b.url for b in self.backends.values() if b.healthy]

    def set_health(self, url: str, ok: bool) -> None:
        b = self.backends[url]
        if b.healthy and not ok:
            log.warning("backend %s left the rotation", url)
            self.cache.forget(url)
        elif ok and not b.healthy:
            log.warning("backend %s rejoined the rotation", url)
        if not ok:
            self.model_lens.pop(url, None)  # learned again when it is back (a restart may change the model)
        b.healthy = ok
        self.metrics.healthy.labels(backend=url).set(1 if ok else 0)

    async def check(self, url: str) -> bool:
        """GET /health answers 200; a server without /health (404) counts if /v1/models answers."""
        assert self.client is not None
        t = self.cfg.health_timeout_s
        try:
            r = await self.client.get(f"{url}/health", timeout=t)
            if r.status_code == 404:
                r = await self.client.get(f"{url}/v1/models", timeout=t)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def check_all(self) -> None:
        urls = list(self.backends)
        results = await asyncio.gather(*(self.check(u) for u in urls))
        for u, ok in zip(urls, results):
            self.set_health(u, ok)
        await asyncio.gather(*(self.learn_models(u) for u, ok in zip(urls, results)
                               if ok and u not in self.model_lens))

    async def learn_models(self, url: str) -> None:
        """Each model's max_model_len as the backend lists it in /v1/models (tokenmill and vLLM do); tried again at
        the next health check if the backend did not answer."""
        assert self.client is not None
        headers = {"authorization": f"Bearer {self.cfg.backend_api_key}"} if self.cfg.backend_api_key else {}
        try:
            r = await self.client.get(f"{url}/v1/models", headers=headers, timeout=self.cfg.health_timeout_s)
            listed = r.json().get("data") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if isinstance(listed, list):
            self.model_lens[url] = {str(m.get("id")): m["max_model_len"] for m in listed
                                    if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)}

    def max_model_len(self, model: object) -> int | None:
        """The longest context any backend serves `model` with (any model's when none lists it: an adapter loaded
        since), None when no backend said. The longest, since the request may land on any of them."""
        lens = [v[model] for v in self.model_lens.values() if model in v]
        return max(lens or [n for v in self.model_lens.values() for n in v.values()], default=None)

    async def health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_all()
            except Exception:
                log.exception("health check")

    # ---- routing -------------------------------------------------------------------------
    def choose(self, candidates: list[str], hashes: list[bytes] | None) -> tuple[str, int]:
        """The backend for this request and its cached leading blocks (0 without cache info)."""
        load = {u: self.backends[u].load for u in candidates}
        matched = None
        if self.policy.uses_cache and hashes:
            matched = {u: self.cache.matched(u, hashes) for u in candidates}
        url = self.policy.choose(candidates, load, matched)
        return url, (matched or {}).get(url, 0)

    async def prompt_info(self, body: dict) -> tuple[int, list[bytes] | None, int]:
        """(estimated tokens, block hashes of the prompt or None, prompt tokens)."""
        ids = None
        if self.policy.uses_cache:
            ids = await asyncio.to_thread(self.prompts.token_ids, body)
        estimate = estimate_tokens(body, ids)
        if ids is None:
            return estimate, None, 0
        # Salted as the backends salt it (the tenant's cache_salt, set by apply_tenant before this is called).
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return estimate, prompt_hashes(ids, self.cfg.block_size or self.cache.block_size, salt), len(ids)

    async def proxy(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return error_response(400, "the request body must be a JSON object.")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        meter, pass_usage = None, True
        tenant = tenant_of(request.scope)
        if self.keys is not None or self.usage is not None:
            headers.pop("authorization", None)
            if self.cfg.backend_api_key:
                headers["authorization"] = f"Bearer {self.cfg.backend_api_key}"
            meter = StreamMeter(echo=bool(body.get("echo")))
            try:
                if tenant is not None:
                    apply_tenant(body, tenant)
                    # Limits count sequences, the work asked for: every prompt x n (refused before tokenizing).
                    admit_sequences(request.scope, self.limiter, tenant,
                                    prompt_count(body) * sequences_per_prompt(body))
                await self.reserve(request.scope, body, tenant, meter)
            except APIError as e:
                return e.response()
            pass_usage = ask_for_usage(body)
            state = request.scope.setdefault("state", {})
            state["model"] = str(body.get("model", "-"))
            state["metered"] = meter.counts
            raw = json.dumps(body).encode()
        estimate, hashes, n_prompt = await self.prompt_info(body)  # after the tenant's salt is in the body
        if self.prefill:
            await self.prefill_first(path, body, headers)
        tried: list[str] = []
        last: BackendFailed | None = None
        for _ in range(2):
            candidates = [u for u in self.healthy() if u not in tried]
            if not candidates:
                break
            url, blocks = self.choose(candidates, hashes)
            if tried:
                self.metrics.retries.labels(backend=tried[-1]).inc()
            tried.append(url)
            if hashes is not None:
                bs = self.cfg.block_size or self.cache.block_size
                self.metrics.query_tokens.labels(backend=url).inc(n_prompt)
                self.metrics.hit_tokens.labels(backend=url).inc(blocks * bs)
            try:
                return await self.forward(url, path, raw, headers, estimate, meter, pass_usage)
            except BackendFailed as e:
                log.warning("backend %s failed: %s", url, e)
                last = e
        if last is not None and last.response is not None:
            return last.response
        if last is not None:
            return error_response(502, f"the backend failed: {last}", "backend_error")
        return error_response(503, "no healthy backend to serve this request.", "no_healthy_backend")

    async def reserve(self, scope: dict, body: dict, tenant: Tenant | None, meter: StreamMeter) -> None:
        """Reserve the request's worst case from the tenant's token budgets (raising the 429): every prompt of a
        batch, n sequences each, max_tokens or else the room max_model_len leaves; the middleware settles it at
        what the backend's usage says. Tells the meter the prompts' tokens (a stream cut short is charged those)."""
        if self.prompts.tokenizer is not None:
            counts = await asyncio.to_thread(self.prompts.counts, body)
        else:
            counts = self.prompts.counts(body)  # lengths only: cheap
        max_len = self.max_model_len(body.get("model"))
        meter.prompt_reserved = reserved_prompt(counts, max_len)
        worst = worst_case(counts, sequences_per_prompt(body), requested_max_tokens(body), max_len)
        reserve_for(scope, self.limiter, tenant, worst, meter.total)

    async def prefill_first(self, path: str, body: dict, headers: dict[str, str]) -> None:
        """PD: compute the prompt's KV on a prefill instance (one token, not streamed) so the decode instance
        loads it instead of computing it. A failed prefill only costs the decode instance the compute."""
        assert self.client is not None
        url = self.prefill[self._prefill_turn % len(self.prefill)]
        self._prefill_turn += 1
        short = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "logprobs", "top_logprobs",
                                                             "n", "best_of", "max_completion_tokens")}
        short.update(max_tokens=1, stream=False)
        t0 = time.monotonic()
        try:
            r = await self.client.post(f"{url}{path}", json=short, headers=headers)
            if r.status_code >= 400:
                raise BackendFailed(f"prefill answered {r.status_code}")
            self.metrics.prefill_seconds.observe(time.monotonic() - t0)
        except (httpx.HTTPError, BackendFailed) as e:
            log.warning("prefill on %s failed (%s): the decode instance computes the prompt", url, e)
            self.metrics.prefill_failures.inc()

    async def forward(self, url: str, path: str, raw: bytes, headers: dict[str, str], estimate: int,
                      meter: StreamMeter | None = None, pass_usage: bool = True) -> Response:
        """Send to one backend; BackendFailed when nothing was returned to the client yet. `meter` reads the
        answer's usage (tenants), dropping a stream's usage chunk unless `pass_usage`."""
        assert self.client is not None
        b, m = self.backends[url], self.metrics
        m.requests.labels(backend=url).inc()
        self._take(b, estimate, 1)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._take(b, -estimate, -1)

        try:
            resp = await self.client.send(self.client.build_request("POST", url + path, content=raw, headers=headers),
                                          stream=True)
        except httpx.HTTPError as e:
            release()
            m.errors.labels(backend=url).inc()
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                self.set_health(url, False)
            raise BackendFailed(f"{type(e).__name__}: {e}") from e
        try:
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
            if resp.status_code >= 500:
                content = await resp.aread()
                m.errors.labels(backend=url).inc()
                raise BackendFailed(f"status {resp.status_code}",
                                    Response(content, resp.status_code, headers=out_headers))
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                content = await resp.aread()
                release()
                if meter is not None:
                    meter.served = resp.status_code < 400  # an error answer used nothing
                    meter.read_json(content)
                return Response(content, resp.status_code, headers=out_headers)
            if meter is not None:
                meter.served = resp.status_code < 400
            chunks = resp.aiter_raw() if meter is None else metered_stream(resp.aiter_raw(), meter, pass_usage)
            first = await anext(chunks, b"")
        except httpx.HTTPError as e:
            await resp.aclose()
            release()
            m.errors.labels(backend=url).inc()
            raise BackendFailed(f"{type(e).__name__}: {e}") from e
        except BaseException:
            await resp.aclose()
            release()
            raise
        async def cleanup() -> None:  # also when the client left before the stream began
            await resp.aclose()
            release()

        return StreamingResponse(self._relay(url, resp, first, chunks, release), resp.status_code,
                                 headers=out_headers, background=BackgroundTask(cleanup))

    async def _relay(self, url: str, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes],
                     release) -> AsyncIterator[bytes]:
        tail = b""
        try:
            if first:
                tail = first[-2:]
                yield first
            async for chunk in chunks:
                if chunk:
                    tail = (tail + chunk)[-2:]
                    yield chunk
        except httpx.HTTPError as e:
            self.metrics.errors.labels(backend=url).inc()
            log.warning("stream from %s broke: %s", url, e)
            prefix = b"" if tail == b"\n\n" or not tail else b"\n\n"
            event = error_body(502, f"the backend's stream broke: {type(e).__name__}", "backend_stream_error")
            yield prefix + f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()
            release()

    def _take(self, b: Backend, tokens: int, requests: int) -> None:
        b.load += tokens
        b.in_flight += requests
        self.metrics.load.labels(backend=b.url).set(b.load)
        self.metrics.in_flight.labels(backend=b.url).set(b.in_flight)

    # ---- other routes --------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        assert self.client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        if self.keys is not None:
            headers = {"authorization": f"Bearer {self.cfg.backend_api_key}"} if self.cfg.backend_api_key else {}
        tenant = tenant_of(request.scope)
        for url in self.healthy():
            try:
                r = await self.client.get(f"{url}/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                content = r.content
                if tenant is not None and r.status_code == 200:  # only what the tenant may use
                    listed = r.json()
                    listed["data"] = [m for m in listed.get("data", []) if tenant.may_use(str(m.get("id")))]
                    content = json.dumps(listed).encode()
                return Response(content, r.status_code, media_type="application/json")
        return error_response(503, "no healthy backend to list models.", "no_healthy_backend")
