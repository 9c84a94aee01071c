"""Back-pressure and shutdown of a live server: 503 + Retry-After over --max-waiting-requests, and a
SIGTERM drain that finishes in-flight requests, aborts what outlives --drain-timeout, and exits 0."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from server_harness import start_server
from tiny import make_tiny_model

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
DRAIN_TIMEOUT = 1.0
# A model and a request long enough that the request outlives the drain timeout on any machine: 4000 tokens take
# 4.5 s offline on a 2-core Zen 4 (~1 ms a token; 480 tokens, the earlier length, finished inside 1 s there).
SLOW = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=4096)
LONG = 4000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("limits") / "llama", "llama", **SLOW)
    srv = start_server(path, path.parent / "server.log", "--served-model-name", MODEL,
                       "--kv-cache-memory-bytes", "64M", "--max-model-len", "4096", "--max-num-seqs", "1",
                       "--max-waiting-requests", "1", "--drain-timeout", str(DRAIN_TIMEOUT))
    yield srv
    srv.stop(signal.SIGKILL)


def body(max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, **kw}


def events(response: httpx.Response):
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            yield line[len("data: "):]


def test_overload_gets_503_with_retry_after(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body(LONG)) as running:
            first = events(running)
            next(first)  # running now; --max-num-seqs 1 keeps the next one waiting
            with http.stream("POST", "/v1/completions", json=body(4)) as waiting:
                assert waiting.status_code == 200
                assert server.wait_metric("tokenmill:num_requests_waiting", 1, 5) == 1
                r = http.post("/v1/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 503, r.text
                assert r.headers["Retry-After"] == "1"
                err = r.json()["error"]
                assert err["code"] == "overloaded" and err["type"] == "server_error"
                running.close()  # frees the slot: the waiting request now runs to the end
                payloads = [e for e in events(waiting)]
                assert payloads[-1] == "[DONE]"
        assert server.wait_metric("tokenmill:num_requests_running", 0, 2) == 0
        ok = http.post("/v1/completions", json=body(3, stream=False))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_sigterm_drains_then_exits(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as a_client, \
            httpx.Client(base_url=server.base_url, timeout=30) as b_client:
        with a_client.stream("POST", "/v1/completions", json=body(10, logprobs=0)) as a:
            a_events = events(a)
            next(a_events)  # A runs; B, sent only now, waits behind it (--max-waiting-requests 1 admits one)
            with b_client.stream("POST", "/v1/completions", json=body(LONG)) as b:
                server.proc.send_signal(signal.SIGTERM)
                _drain_checks(a_events, b)
        # New connections are refused while draining and after.
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url("/health"), timeout=2)
    assert server.proc.wait(60) == 0  # a backstop: a clean stop takes well under a second
    assert "draining" in server.log()


def _drain_checks(a_events, b) -> None:
    """After SIGTERM: A (in the drain timeout) ends normally, B (too long) with a shutting_down error."""
    # A finishes within the drain timeout, untouched.
    rest = list(a_events)
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # B would need seconds: the drain aborts it with an error event, then ends the stream.
    b_payloads = list(events(b))
    assert b_payloads[-1] == "[DONE]"
    error = json.loads(b_payloads[-2])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
