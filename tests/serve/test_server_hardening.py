"""One hostile or expensive request never hurts anyone else: the four attacks of issue 16, each against a live
server with a victim request beside it. The attacker gets a 400 naming the limit (or its bounded answer), the
victim's output is what it is alone and its latency stays within 2x of a control measured beside it (the victim
alone, or beside benign requests doing the same generation work), and the KV cache
empties afterwards. Plus the API key on every route that does work, and the body and header timeouts."""
from __future__ import annotations

import asyncio
import socket
import statistics
import time

import httpx
import pytest

from server_harness import start_server
from tiny import make_tiny_model

pytestmark = pytest.mark.timeout(180)

KEY = "sk-hardening"
MODEL = "tiny"
MAX_LEN = 512
# About 5 ms a token here: a victim of 24 tokens takes long enough to measure against the attacks.
SLOW = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4)
MAX_INPUT_CHARS = 300_000
VICTIM = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("hardening") / "llama", "llama", **SLOW)
    srv = start_server(path, path.parent / "server.log", "--served-model-name", MODEL,
                       "--kv-cache-memory-bytes", "32M", "--max-model-len", str(MAX_LEN),
                       "--max-input-chars", str(MAX_INPUT_CHARS), "--request-body-timeout", "3",
                       "--request-header-timeout", "1", api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def baseline(server):
    """The victim alone: its text (timings are compared within each test, interleaved with a control)."""
    return asyncio.run(_victim_runs(server, None))


async def _victim(http: httpx.AsyncClient) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = await http.post("/v1/completions", json=VICTIM)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], time.perf_counter() - t0


async def _victim_runs(server, attack, rounds: int = 3, control=None) -> tuple[str, float, list, float]:
    """The victim `rounds` times with `attack(http)` (a list of coroutines) sent at the same moment, and as many
    times, interleaved, with `control(http)` (None: alone), so both see the same machine load:
    (its text, its median latency under attack, the attackers' responses, its median latency in the control)."""
    texts, times, control_times, answers = [], [], [], []
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=120) as http:
        await _victim(http)  # warm
        for _ in range(rounds):
            for make, out in ((attack, times), (control, control_times)):
                others = [asyncio.ensure_future(c) for c in (make(http) if make else [])]
                text, seconds = await _victim(http)
                results = await asyncio.gather(*others)
                if out is times:
                    answers += results
                texts.append(text)
                out.append(seconds)
    assert len(set(texts)) == 1, texts
    return texts[0], statistics.median(times), answers, statistics.median(control_times)


def check_victim(server, baseline, attack, control=None, rounds: int = 5) -> list[httpx.Response]:
    """The victim's output under attack is its output alone, and its latency stays within 2x of the control's
    (alone, or beside `control`: benign requests doing the same generation work as the attack)."""
    text, seconds, answers, control_seconds = asyncio.run(_victim_runs(server, attack, rounds, control))
    alone_text, _, _, _ = baseline
    assert text == alone_text
    assert seconds <= 2 * control_seconds, \
        f"victim took {seconds:.3f} s under attack, {control_seconds:.3f} s in the control"
    assert server.wait_metric("tokenmill:kv_cache_usage_perc", 0, 10) == 0
    assert server.wait_metric("tokenmill:num_requests_running", 0, 10) == 0
    return answers


def assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    for w in words:
        assert w in err["message"], err["message"]


# ---- 1. one bad sampling value failed the whole batch --------------------------------------------------
def test_top_k_overflow_is_a_400_and_the_batch_runs_on(server, baseline):
    def attack(http):
        return [http.post(path, json={**body, "top_k": 2**63, "stream": stream})
                for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT))
                for stream in (False, True)]

    for r in check_victim(server, baseline, attack):
        assert_400(r, "top_k", "64-bit")
    # At the edge of int64 it is valid: beyond the vocabulary top-k keeps every token.
    r = httpx.post(server.url("/v1/completions"), headers=server.headers,
                   json={**COMPLETION, "top_k": 2**63 - 1, "seed": -(2**63), "n": 2})
    assert r.status_code == 200, r.text


# ---- 2. /tokenize outside the API key, and large inputs stalling others ----------------------------------
@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/models", "/v1/diagnostics",
                                  "/v1/kv_events", "/docs-not-a-route"])
def test_the_api_key_covers_every_route_that_does_work(server, path):
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [5, 6]}
    method = "POST" if path in ("/tokenize", "/detokenize") else "GET"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, server.url(path), json=body if method == "POST" else None, headers=headers)
        assert r.status_code == 401, (path, headers, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.request(method, server.url(path), json=body if method == "POST" else None, headers=server.headers)
    assert r.status_code == (404 if "not-a-route" in path else 200), r.text


def test_health_version_and_metrics_stay_open(server):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.url(path)).status_code == 200, path


def test_large_tokenize_calls_do_not_stall_a_running_request(server, baseline):
    big = "The quick brown fox jumps over the lazy dog. " * (MAX_INPUT_CHARS // 45)

    def attack(http):
        return [http.post("/tokenize", json={"prompt": big}) for _ in range(4)]

    for r in check_victim(server, baseline, attack):
        assert r.status_code == 200 and r.json()["count"] > 10_000
    r = httpx.post(server.url("/tokenize"), headers=server.headers, json={"prompt": big + "x" * 1000})
    assert_400(r, "prompt", "--max-input-chars", str(MAX_INPUT_CHARS))
    r = httpx.post(server.url("/v1/chat/completions"), headers=server.headers,
                   json={**CHAT, "messages": [{"role": "user", "content": big + "x" * 1000}]})
    assert_400(r, "messages", "--max-input-chars")


# ---- 3. unbounded stop strings ----------------------------------------------------------------------------
def test_stop_strings_are_bounded_and_cheap(server, baseline):
    r = httpx.post(server.url("/v1/completions"), headers=server.headers,
                   json={**COMPLETION, "stop": ["x" * 300 + str(i) for i in range(10_000)]})
    assert_400(r, "stop", "--max-stop-strings", "16")
    r = httpx.post(server.url("/v1/completions"), headers=server.headers, json={**COMPLETION, "stop": "y" * 257})
    assert_400(r, "stop", "--max-stop-string-length", "256")

    def attack(http):  # as many and as long as allowed, generating as long as the victim
        stops = [chr(0x4E00 + i) * 256 for i in range(16)]
        return [http.post("/v1/completions", json={**VICTIM, "stop": stops, "stream": s}) for s in (False, True)]

    def control(http):  # the same generations without stop strings: batch 3 costs more than batch 1 anyway
        return [http.post("/v1/completions", json={**VICTIM, "stream": s}) for s in (False, True)]

    for r in check_victim(server, baseline, attack, control):
        assert r.status_code == 200, r.text


# ---- 4. n x max_tokens x logprobs amplification -------------------------------------------------------
def test_n_and_the_request_token_budget_bound_one_request(server, baseline):
    def attack(http):
        return [http.post("/v1/completions", json={**COMPLETION, "n": 128, "max_tokens": 160, "logprobs": 20})
                for _ in range(4)]

    for r in check_victim(server, baseline, attack):
        assert_400(r, "n", "--max-n", "16")
    budget = 8 * MAX_LEN
    r = httpx.post(server.url("/v1/completions"), headers=server.headers,
                   json={**COMPLETION, "n": 16, "max_tokens": 300, "logprobs": 20})
    assert_400(r, "max_tokens", "--max-request-tokens", str(budget))
    r = httpx.post(server.url("/v1/completions"), headers=server.headers,
                   json={**COMPLETION, "prompt": ["a b c"] * 16, "max_tokens": 300})
    assert_400(r, "max_tokens", "over all prompts")
    # Without max_tokens, chat gives each of the n sequences its share of the budget (bounded, not refused).
    r = httpx.post(server.url("/v1/chat/completions"), headers=server.headers, timeout=120,  # 4k tokens of work
                   json={**CHAT, "max_tokens": None, "n": 16, "ignore_eos": True, "temperature": 0.5})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= budget
    assert server.wait_metric("tokenmill:kv_cache_usage_perc", 0, 10) == 0


# ---- timeouts ---------------------------------------------------------------------------------------------
def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_a_body_that_does_not_arrive_gets_408(server):
    with _connect(server) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        reply = _read_all(s)  # the server answers and closes
        assert time.monotonic() - t0 < 8
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply
    assert httpx.get(server.url("/health")).status_code == 200


def test_headers_trickled_in_are_cut_off(server):
    with _connect(server) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(40):  # a header byte every 0.1 s: each resets uvicorn's own keep-alive timer
            try:
                s.sendall(b"X")
                s.settimeout(0.1)
                if s.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, "the connection was still open after 4 s of trickled headers"
        assert time.monotonic() - t0 < 4
    assert httpx.get(server.url("/health")).status_code == 200


def _read_response(s: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length body, the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head


def test_kept_alive_connection_idles_past_the_header_timeout_then_trickling_is_cut(server):
    """The header deadline (1 s here) runs from a request's first byte: a pooled connection idle for longer
    still serves its next request; trickling that connection's next headers is still cut off."""
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(server) as s:
        s.sendall(get)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # longer than --request-header-timeout, shorter than uvicorn's keep-alive (5 s)
        s.sendall(get)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\n")
        s.settimeout(0.1)
        closed = False
        while time.monotonic() - t0 < 4 and not closed:
            try:
                s.sendall(b"X")
                closed = s.recv(1) == b""
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed, "trickled headers on a kept-alive connection were not cut off"
