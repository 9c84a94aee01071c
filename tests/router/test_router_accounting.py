"""Exact accounting behind `tokenmill router`: what a tenant is charged equals what the backends served, whatever
the request's shape (batches, n, unset max_tokens, echo, streams cut short by the client or broken by the
backend, errors); token budgets hold at their boundary under 50 concurrent requests of those shapes (every
reservation covers its request's worst case, so served tokens never pass the quota); and concurrency and
per-minute limits count sequences (prompts x n), not HTTP requests.

The backends are a small fake (in this file) that keeps a ledger of what each request used: prompt tokens (token
ids: their count; text: one per word plus one) and the completion tokens it sent, also for a stream the client
left or that broke mid-way."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from server_harness import serve_in_thread
from tokenmill.router.app import RouterConfig, create_app
from tokenmill.router.prompts import worst_case

DAY = 20_000  # the fixed UTC day of the routers' limiters in these tests
MODEL = "m"


# ---- a backend that keeps a ledger ---------------------------------------------------------------------------
@dataclass
class Ledger:
    max_model_len: int
    lists_max_model_len: bool = True  # in /v1/models (tokenmill and vLLM do)
    used: dict[int, int] = field(default_factory=dict)  # request number -> prompt + completion tokens served
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, req: int, tokens: int) -> None:
        with self.lock:
            self.used[req] = self.used.get(req, 0) + tokens

    def total(self) -> int:
        with self.lock:
            return sum(self.used.values())


def _prompt_tokens(body: dict) -> list[int]:
    if "messages" in body:
        return [sum(len(str(m.get("content", "")).split()) + 3 for m in body["messages"])]
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    return [len(p) if isinstance(p, list) else len(p.split()) + 1 for p in prompts]


def backend_app(ledger: Ledger) -> Starlette:
    counter = iter(range(1 << 30))

    async def generate(request: Request):
        body = await request.json()
        req = next(counter)
        chat = "messages" in body
        prompts = _prompt_tokens(body)
        n, limit = int(body.get("n") or 1), ledger.max_model_len
        if max(prompts) >= limit:
            return JSONResponse({"error": {"message": "prompt too long", "type": "BadRequestError", "param": None,
                                           "code": 400}}, 400)
        m = body.get("max_tokens")
        outputs = [min(m, limit - p) if m is not None else limit - p for p in prompts]  # per choice of prompt j
        ledger.add(req, sum(prompts))
        usage = {"prompt_tokens": sum(prompts), "completion_tokens": n * sum(outputs),
                 "total_tokens": sum(prompts) + n * sum(outputs)}
        if not body.get("stream"):
            ledger.add(req, usage["completion_tokens"])
            choices = [{"index": j * n + i, "finish_reason": "length",
                        **({"message": {"role": "assistant", "content": " t" * out}} if chat else {"text": " t" * out})}
                       for j, out in enumerate(outputs) for i in range(n)]
            return JSONResponse({"object": "chat.completion" if chat else "text_completion", "model": MODEL,
                                 "choices": choices, "usage": usage})
        cut, broken = body.get("cut_after"), body.get("break_after")

        async def stream():
            sent = 0
            for j, out in enumerate(outputs):
                for i in range(n):
                    index = j * n + i
                    if chat:
                        yield _sse({"choices": [{"index": index, "delta": {"role": "assistant", "content": ""}}]})
                    for k in range(out):
                        text = " t" if k or not body.get("echo") else "prompt text t"
                        choice = {"index": index, **({"delta": {"content": text}} if chat else {"text": text})}
                        yield _sse({"choices": [choice]})
                        ledger.add(req, 1)  # sent
                        sent += 1
                        if sent == cut:
                            await asyncio.Event().wait()  # until the client leaves
                        if sent == broken:
                            raise RuntimeError("the backend's connection dropped")
                    yield _sse({"choices": [{"index": index, "text": "", "finish_reason": "length"}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(request: Request):
        card = {"id": MODEL, "object": "model"}
        if ledger.lists_max_model_len:
            card["max_model_len"] = ledger.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request):
        return JSONResponse({})

    return Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(app):
    return serve_in_thread(app, backlog=256)  # 50 concurrent requests at the quota's boundary


KEYS = """
tenants:
  - name: acct
    keys: ["sk-acct"]
    limits: {tokens_per_day: 1000000}
  - name: quota
    keys: ["sk-quota"]
    limits: {tokens_per_day: 3000}
  - name: other
    keys: ["sk-other"]
    limits: {tokens_per_day: 1000000, tokens_per_minute: 100000}
  - name: one
    keys: ["sk-one"]
    limits: {concurrent: 1}
  - name: rpm
    keys: ["sk-rpm"]
    limits: {requests_per_minute: 4, concurrent: 4}
"""


@contextmanager
def setup(tmp_path, max_model_len: int, lists_max_model_len: bool = True):
    """Two ledger backends behind a router with tenants and a usage db; the limiter's clocks stand still."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    ledger = Ledger(max_model_len, lists_max_model_len)
    with serve(backend_app(ledger)) as a, serve(backend_app(ledger)) as b:
        app = create_app(RouterConfig(backends=[a, b], api_keys_file=str(keys), admin_key="sk-admin",
                                      usage_db=str(tmp_path / "usage.db"), health_interval_s=0.2))
        router = app.state.router
        router.limiter.clock = lambda: 0.0
        router.limiter.wall = lambda: DAY * 86400.0 + 3600
        with serve(app) as url:
            yield url, router, ledger


def post(url: str, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)


def stream(url: str, key: str, body: dict, stop_after: int | None = None, path: str = "/v1/completions"):
    """(status, the data events read); with stop_after, the client leaves after that many content events."""
    events = []
    with httpx.stream("POST", url + path, json={"model": MODEL, **body, "stream": True}, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                content = [e for e in events if '"text": " t"' in e or '"content": " t"' in e]
                if stop_after is not None and len(content) >= stop_after:
                    break
    return s.status_code, events


def settled(url: str, router, deadline_s: float = 10.0) -> None:
    """Wait (with a deadline) until no request of any tenant is in flight at the router, then until its event
    loop answers once more: the middleware's release, settle and metering of each have all run."""
    deadline = time.monotonic() + deadline_s
    while router.limiter.in_flight:
        assert time.monotonic() < deadline, router.limiter.in_flight
        time.sleep(0.01)
    httpx.get(url + "/health", timeout=10)


def charged(router, tenant: str) -> int:
    return router.limiter.day_used.get((tenant, DAY), 0)


def ids(k: int, start: int = 1) -> list[int]:
    return list(range(start, start + k))


def batch_of(worst: int, max_model_len: int) -> list[list[int]]:
    """Token-id prompts whose worst case with max_tokens=1 is exactly `worst` (>= 2): k prompts of p_i tokens
    each may use p_i + 1, each within max_model_len."""
    k = -(-worst // max_model_len)
    size, extra = divmod(worst - k, k)
    return [ids(size + (i < extra)) for i in range(k)]


# ---- the tests --------------------------------------------------------------------------------------------------
def test_worst_case_covers_every_prompt_n_and_the_room_left():
    assert worst_case([(10, 10)], 1, None, 100) == 100  # unset max_tokens: the room max_model_len leaves
    assert worst_case([(10, 10), (20, 20)], 2, None, 100) == 10 + 2 * 90 + 20 + 2 * 80  # every prompt, n each
    assert worst_case([(10, 10)], 3, 5, 100) == 10 + 15
    assert worst_case([(10, 10)], 1, 500, 100) == 100  # max_tokens beyond the room: the room
    # A text prompt known within (1, 40): the worst over that range (a short prompt leaves the most room).
    assert worst_case([(1, 40)], 4, None, 100) == 1 + 4 * 99
    assert worst_case([(1, 40)], 1, 30, 100) == 40 + 30
    assert worst_case([(150, 150)], 1, 5, 100) == 150  # too long: the backend refuses it
    assert worst_case([(10, 10)], 2, None, None) == 10 + 2 * 256  # no max_model_len known: the default


def test_the_router_charges_exactly_what_the_backends_served(tmp_path):
    """Batches, unset max_tokens, n > 1, echo, chat, streams left by the client and broken by the backend, a
    backend's 400: the tenant's charge (its day budget) and the usage db both equal the backends' ledger."""
    with setup(tmp_path, max_model_len=40) as (url, router, ledger):
        r = post(url, "sk-acct", {"prompt": [ids(3), ids(5), ids(7)], "n": 2, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 15 + 2 * 3 * 5
        r = post(url, "sk-acct", {"prompt": ["one two three", "four five"], "n": 2})  # max_tokens unset
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * (36 + 37)
        r = post(url, "sk-acct", {"prompt": ids(6), "echo": True, "max_tokens": 4, "logprobs": 1})
        assert r.status_code == 200
        r = post(url, "sk-acct", {"messages": [{"role": "user", "content": "hi there"}], "n": 3},
                 "/v1/chat/completions")
        assert r.status_code == 200
        code, events = stream(url, "sk-acct", {"messages": [{"role": "user", "content": "a b c"}], "n": 2,
                                               "max_tokens": 3}, path="/v1/chat/completions")
        assert code == 200 and events[-1] == "[DONE]" and not any('"usage"' in e for e in events)
        code, events = stream(url, "sk-acct", {"prompt": ids(8), "echo": True, "max_tokens": 6})
        assert code == 200 and events[-1] == "[DONE]"
        # The client leaves a batch x n stream with unset max_tokens after 5 tokens: charged its prompts + 5.
        code, _ = stream(url, "sk-acct", {"prompt": [ids(4), ids(9)], "n": 2, "cut_after": 5}, stop_after=5)
        assert code == 200
        # The backend's connection drops after 3 tokens: the router ends the stream with an error event.
        code, events = stream(url, "sk-acct", {"prompt": ids(5), "n": 2, "break_after": 3})
        assert code == 200 and "backend_stream_error" in events[-2]
        r = post(url, "sk-acct", {"prompt": ids(45)})  # longer than max_model_len: the backend's 400
        assert r.status_code == 400
        settled(url, router)
        served = ledger.total()
        assert charged(router, "acct") == served
        rows = httpx.get(url + "/v1/usage", params={"group_by": "tenant"}, timeout=30,
                         headers={"Authorization": "Bearer sk-admin"}).json()["data"]
        (row,) = [row for row in rows if row["tenant"] == "acct"]
        assert row["prompt_tokens"] + row["completion_tokens"] == served


def test_usage_beyond_a_reservation_is_charged_and_refuses_until_repaid(tmp_path):
    """No backend says max_model_len: a request without max_tokens reserves the default 256 a sequence and uses
    more; the overage is charged (the day budget goes into debt) and the next request is refused."""
    with setup(tmp_path, max_model_len=1000, lists_max_model_len=False) as (url, router, ledger):
        r = post(url, "sk-quota", {"prompt": ids(10), "n": 2})  # reserves 10 + 2 x 256, uses 10 + 2 x 990
        assert r.status_code == 200
        settled(url, router)
        assert charged(router, "quota") == ledger.total() == 1990
        r = post(url, "sk-quota", {"prompt": ids(10), "max_tokens": 1000 - 990})  # 20 would fit before the debt
        assert r.status_code == 200
        r = post(url, "sk-quota", {"prompt": ids(10), "n": 2})
        assert r.status_code == 200  # 2010 used, 522 reserved: fits
        settled(url, router)
        assert charged(router, "quota") == ledger.total() == 4000  # 1000 beyond the 3000 a day: debt
        r = post(url, "sk-quota", {"prompt": ids(2), "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        assert int(r.headers["Retry-After"]) == 23 * 3600
        assert post(url, "sk-other", {"prompt": ids(2), "max_tokens": 1}).status_code == 200  # others go on


def test_quota_holds_at_its_boundary_under_50_concurrent_requests(tmp_path):
    """50 requests at once from one tenant with 3000 tokens a day, of every shape that used to slip past the
    reservation: batches and n with max_tokens unset, echo, streams the client leaves mid-way. Served tokens
    never pass the quota, the charge equals them, and another tenant is not touched."""
    with setup(tmp_path, max_model_len=400) as (url, router, ledger):
        shapes = [
            lambda: post(url, "sk-quota", {"prompt": [ids(10), ids(10, 50), ids(10, 90)]}),  # 3 x 400
            lambda: post(url, "sk-quota", {"prompt": ids(10), "n": 2}),  # 10 + 2 x 390
            lambda: post(url, "sk-quota", {"prompt": ids(10), "echo": True, "max_tokens": 50}),
            lambda: stream(url, "sk-quota", {"prompt": ids(10), "n": 2, "cut_after": 2}, stop_after=2),
            lambda: post(url, "sk-quota", {"messages": [{"role": "user", "content": "x y"}], "n": 2},
                         "/v1/chat/completions"),
        ]

        def status(result) -> int:
            return result.status_code if isinstance(result, httpx.Response) else result[0]

        with ThreadPoolExecutor(50) as pool:
            results = list(pool.map(lambda i: shapes[i % len(shapes)](), range(50)))
        codes = [status(x) for x in results]
        assert set(codes) == {200, 429}, codes
        settled(url, router)
        served = ledger.total()
        assert served <= 3000
        assert charged(router, "quota") == served
        assert charged(router, "other") == 0 and "other" not in router.limiter.token_buckets
        # What is left is exactly 3000 - served: a request whose worst case is one token more is refused, one
        # that may use all of it runs (and does), and then the budget is spent to the token.
        left = 3000 - served
        r = post(url, "sk-quota", {"prompt": batch_of(left + 1, 400), "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        if left >= 2:
            assert post(url, "sk-quota", {"prompt": batch_of(left, 400), "max_tokens": 1}).status_code == 200
            settled(url, router)
            assert charged(router, "quota") == ledger.total() == 3000


def test_concurrency_and_request_limits_count_sequences(tmp_path):
    """One concurrent request is one sequence: a batch or n > 1 in it is refused, saying why; requests per
    minute likewise count prompts x n. The slots come back when the requests end."""
    with setup(tmp_path, max_model_len=40) as (url, router, ledger):
        r = post(url, "sk-one", {"prompt": [ids(2), ids(2)], "n": 2, "max_tokens": 1})
        assert r.status_code == 429 and "4 sequences" in r.json()["error"]["message"]
        assert post(url, "sk-one", {"prompt": ids(2), "n": 2, "max_tokens": 1}).status_code == 429
        assert post(url, "sk-one", {"prompt": ids(2), "max_tokens": 1}).status_code == 200
        assert post(url, "sk-rpm", {"prompt": ids(2), "n": 3, "max_tokens": 1}).status_code == 200  # 3 of 4
        r = post(url, "sk-rpm", {"prompt": [ids(2), ids(3)], "max_tokens": 1})  # 2 more: over the minute's 4
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "Retry-After" in r.headers
        settled(url, router)
        assert router.limiter.in_flight == {}
