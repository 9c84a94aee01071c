"""Fuzz the live server: over a thousand hostile requests (tests/fuzz_cases.py: every endpoint, every request
field, raw malformed bodies, wrong methods and paths, bad API keys), sent in concurrent groups.

Per case: no 5xx; every error is OpenAI's shape {"error": {"message", "type", "param", "code"}}; a stream is
well-formed SSE that ends with `data: [DONE]` and carries no server error; a request without the right key to a
path that needs one is a 401. Per group: victim requests running alongside the hostile ones (a greedy completion,
plain and streamed) produce exactly what the same request produces alone. At the end the KV cache is empty again
and the server is healthy. Every failing case is collected and reported at once, named by endpoint, field and
value, with the server's tracebacks.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from fuzz_cases import MODEL, PROMPT, Case, generate
from server_harness import start_server
from tiny import make_tiny_model

pytestmark = pytest.mark.timeout(600)

KEY = "sk-fuzz-0123456789"
MAX_LEN = 512
GROUP = 20  # hostile requests in flight at once, next to the victims
VICTIM = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("fuzz") / "llama", "llama")
    srv = start_server(path, path.parent / "server.log", "--served-model-name", MODEL, "alias",
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", str(MAX_LEN),
                       "--max-request-body-bytes", "1M", api_key=KEY)
    yield srv
    rc = srv.stop()
    assert rc == 0, srv.log()[-5000:]


# ---- checking one response --------------------------------------------------------------------------
def error_shape_problem(body) -> str | None:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"error body is not {{'error': {{...}}}}: {str(body)[:200]}"
    err = body["error"]
    if set(err) != ERROR_KEYS:
        return f"error keys are {sorted(err)}, want {sorted(ERROR_KEYS)}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"error.message is {err['message']!r}"
    if not isinstance(err["type"], str):
        return f"error.type is {err['type']!r}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"error.param is {err['param']!r}"
    if err["code"] is not None and not isinstance(err["code"], (str, int)):
        return f"error.code is {err['code']!r}"
    return None


def sse_problem(text: str) -> str | None:
    events = []
    for line in text.split("\n"):
        if not line:
            continue
        if not line.startswith("data: "):
            return f"SSE line without 'data: ': {line[:200]!r}"
        events.append(line[len("data: "):])
    if not events or events[-1] != "[DONE]":
        return f"SSE stream does not end with [DONE]; last event {events[-1][:200] if events else None!r}"
    for e in events[:-1]:
        try:
            payload = json.loads(e)
        except ValueError:
            return f"SSE event is not JSON: {e[:200]!r}"
        if isinstance(payload, dict) and "error" in payload:
            problem = error_shape_problem(payload)
            if problem:
                return "SSE error event: " + problem
            err = payload["error"]
            if err["type"] == "server_error" or err["code"] == "internal_error":
                return f"SSE error event from the server: {err}"
    return None


def response_problem(case: Case, r: httpx.Response) -> str | None:
    """What is wrong with the server's answer to one case, or None."""
    ctype = r.headers.get("content-type", "")
    excerpt = r.text[:300].replace("\n", "\\n")
    if r.status_code >= 500:
        return f"status {r.status_code}: {excerpt}"
    if case.expect_401 and r.status_code != 401:
        return f"status {r.status_code}, want 401 (no/wrong API key): {excerpt}"
    if r.status_code >= 400:
        if case.method == "HEAD":
            return None
        try:
            body = r.json()
        except ValueError:
            return f"status {r.status_code} with a non-JSON body ({ctype}): {excerpt}"
        problem = error_shape_problem(body)
        return f"status {r.status_code}: {problem}" if problem else None
    if ctype.startswith("text/event-stream"):
        problem = sse_problem(r.text)
        return f"status {r.status_code}: {problem}" if problem else None
    if ctype.startswith("application/json"):
        try:
            body = r.json()
        except ValueError:
            return f"status {r.status_code}: body is not JSON: {excerpt}"
        if case.path in ("/v1/completions", "/v1/chat/completions") and r.status_code == 200 and \
                not (isinstance(body, dict) and body.get("choices")):
            return f"status 200 without choices: {excerpt}"
    return None


# ---- sending ----------------------------------------------------------------------------------------
def _headers(case: Case):
    headers = {"Content-Type": "application/json"}
    if case.auth:
        headers.update(AUTH)
    extra = dict(case.headers)
    second = extra.pop("__extra_authorization__", None)
    headers.update(extra)
    items = [(k, v) for k, v in headers.items() if not (k == "Content-Type" and v == "")]
    if second is not None:
        items.append(("Authorization", second))
    return items


async def send(client: httpx.AsyncClient, case: Case) -> tuple[Case, str | None, int | None, float]:
    content = case.content
    if case.chunked and content is not None:
        data = content

        async def chunks():
            for i in range(0, len(data), 65536):
                yield data[i:i + 65536]

        content = chunks()
    t0 = time.monotonic()
    try:
        r = await client.request(case.method, case.path, content=content, headers=_headers(case))
    except Exception as e:  # the server closed the connection, timed out, ...
        return case, f"no response: {type(e).__name__}: {str(e)[:200]}", None, time.monotonic() - t0
    return case, response_problem(case, r), r.status_code, time.monotonic() - t0


def completion_text(r: httpx.Response, streamed: bool) -> str:
    if r.status_code != 200:
        raise AssertionError(f"status {r.status_code}: {r.text[:300]}")
    if not streamed:
        return r.json()["choices"][0]["text"]
    problem = sse_problem(r.text)
    if problem:
        raise AssertionError(problem)
    events = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")][:-1]
    payloads = [json.loads(e) for e in events]
    errors = [p["error"] for p in payloads if "error" in p]
    if errors:
        raise AssertionError(f"error event: {errors[0]}")
    return "".join(p["choices"][0]["text"] for p in payloads if p.get("choices"))


async def victim(client: httpx.AsyncClient, streamed: bool, delay: float) -> str:
    await asyncio.sleep(delay)
    body = {**VICTIM, "stream": True} if streamed else VICTIM
    r = await client.post("/v1/completions", json=body, headers=AUTH)
    return completion_text(r, streamed)


def server_tracebacks(log: str, limit: int = 40) -> list[str]:
    """`unhandled error on POST /path` with the exception line that ends its traceback, and any engine errors."""
    lines = log.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "unhandled error on" in line or re.search(r"\b(ERROR|CRITICAL)\b", line):
            exc = next((l for l in lines[i + 1:i + 200] if re.match(r"^[\w.]+(Error|Exception)\b", l)), "")
            out.append(f"{line.strip()[:200]} -> {exc.strip()[:300]}")
    return list(dict.fromkeys(out))[:limit]


# ---- the test -------------------------------------------------------------------------------------
RERUN_LIMIT = 80  # failing cases re-run alone, to tell a case's own failure from collateral damage


def test_fuzz_every_endpoint_and_field(server):
    cases = generate(KEY)
    assert len(cases) >= 500
    base = server.base_url
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as http:
        alone = completion_text(http.post("/v1/completions", json=VICTIM), False)
        alone_streamed = completion_text(http.post("/v1/completions", json={**VICTIM, "stream": True}), True)
    assert alone == alone_streamed and alone

    failed: dict[str, tuple[Case, str, int]] = {}  # case name -> (case, problem, group start)
    broken_victims: list[str] = []
    timings: list[tuple[float, str]] = []
    statuses: dict[int | None, int] = {}
    reruns: dict[str, tuple[str | None, list[str]]] = {}  # name -> (problem alone, what its victims got)

    def victim_problems(results) -> list[str]:
        out = []
        for which, got in zip(("victim", "streamed victim"), results):
            if isinstance(got, BaseException) or got != alone:
                what = f"{type(got).__name__}: {got}" if isinstance(got, BaseException) else f"text {got!r}"
                out.append(f"{which} got {what[:300]} (alone: {alone!r})")
        return out

    async def main(client: httpx.AsyncClient):
        for g in range(0, len(cases), GROUP):
            group = cases[g:g + GROUP]
            results = await asyncio.gather(*(send(client, c) for c in group),
                                           victim(client, False, 0.0), victim(client, True, 0.05),
                                           return_exceptions=True)
            for case, problem, status, took in results[:len(group)]:
                statuses[status] = statuses.get(status, 0) + 1
                timings.append((took, case.name))
                if problem:
                    failed.setdefault(case.name, (case, problem, g))
            for p in victim_problems(results[len(group):]):
                ran = [f"{c.name} -> {st}" for c, pr, st, _ in results[:len(group)] if pr or st == 200]
                broken_victims.append(f"{p}, next to cases {g}..{g + len(group) - 1}; of those, failed or ran: "
                                      + "; ".join(ran[:6]))

    async def rerun(client: httpx.AsyncClient):
        """Each failed case again, alone but for the victims, which start first so it lands in their batch."""
        for name, (case, _, _) in list(failed.items())[:RERUN_LIMIT]:
            async def hostile():
                await asyncio.sleep(0.02)
                return await send(client, case)
            got = await asyncio.gather(victim(client, False, 0.0), hostile(), victim(client, True, 0.01),
                                       return_exceptions=True)
            own = got[1][1] if not isinstance(got[1], BaseException) else f"{type(got[1]).__name__}: {got[1]}"
            reruns[name] = (own, victim_problems([got[0], got[2]]))

    async def both():
        limits = httpx.Limits(max_connections=GROUP + 4, max_keepalive_connections=GROUP + 4)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
            await main(client)
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            await rerun(client)

    t0 = time.monotonic()
    asyncio.run(both())
    elapsed = time.monotonic() - t0

    # The server cleaned up after all of it and still serves the victim the same way.
    after_run: list[str] = []
    kv = server.wait_metric("tokenmill:kv_cache_usage_perc", 0, 10)
    running = server.wait_metric("tokenmill:num_requests_running", 0, 10)
    if kv != 0 or running != 0:
        after_run.append(f"kv_cache_usage_perc={kv}, num_requests_running={running} (want 0, 0)")
    try:
        health = httpx.get(server.url("/health"), timeout=10).status_code
        later = completion_text(httpx.post(server.url("/v1/completions"), json=VICTIM, headers=AUTH, timeout=60),
                                False)
    except Exception as e:
        health, later = None, f"{type(e).__name__}: {e}"
    if health != 200 or later != alone:
        after_run.append(f"/health {health}, victim alone {later!r} (want {alone!r})")

    slowest = sorted(timings, reverse=True)[:5]
    print(f"\n{len(cases)} cases in {elapsed:.1f} s; statuses {dict(sorted(statuses.items(), key=str))}; "
          f"slowest {[(round(t, 2), n) for t, n in slowest]}")

    own, collateral, breakers = [], [], []
    for name, (case, problem, g) in failed.items():
        if name not in reruns:
            own.append(f"{name}: {problem} (not re-run)")
            continue
        alone_problem, victims = reruns[name]
        if alone_problem:
            own.append(f"{name}: {alone_problem}")
        else:
            collateral.append(f"{name}: {problem} (passes alone; its group started at case {g})")
        if victims:
            breakers.append(f"{name}: " + "; ".join(victims))
    sections = [("fail on their own", own), ("break a concurrent victim request", breakers),
                ("victims broken during the concurrent run", broken_victims),
                ("failed only next to other hostile requests", collateral), ("after the run", after_run)]
    if any(items for _, items in sections):
        report = [f"{len(failed)} of {len(cases)} fuzz cases failed, {len(broken_victims)} victim(s) broken "
                  f"(server log {server.log_path})"]
        for title, items in sections:
            if items:
                report.append(f"-- {title} ({len(items)}):")
                report += [f"  {x}" for x in items]
        report.append("-- server errors:")
        report += [f"  {x}" for x in server_tracebacks(server.log())]
        pytest.fail("\n".join(report), pytrace=False)
