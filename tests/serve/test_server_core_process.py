"""`tokenmill serve` with the engine core in its own process: killing that process mid-stream ends every
open request with an error, /health turns 503, new requests are refused, and nothing hangs."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_harness import spawned_children, start_server
from tiny import make_tiny_model

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
# Slow enough (a few ms a token) that a long request is still running when the core is killed.
SLOW = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4)


def core_pid(server_pid: int) -> int:
    """The spawned engine-core process (not multiprocessing's resource tracker)."""
    found = spawned_children(server_pid)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("coreproc") / "llama", "llama", **SLOW)
    srv = start_server(path, path.parent / "server.log", "--served-model-name", MODEL,
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", "512")
    yield srv
    srv.stop(signal.SIGKILL)


def stream_events(client: httpx.Client, body: dict, first: threading.Event, sink: list) -> None:
    with client.stream("POST", "/v1/completions", json=body) as r:
        sink.append(r.status_code)
        for line in r.iter_lines():
            if line:
                sink.append(line)
                first.set()


def test_killing_the_core_process_fails_open_requests_and_health(server):
    assert httpx.get(server.url("/health"), timeout=5).status_code == 200
    pid = core_pid(server.proc.pid)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    client = httpx.Client(base_url=server.base_url, timeout=30)
    streams, threads = [], []
    for _ in range(3):
        first, sink = threading.Event(), []
        t = threading.Thread(target=stream_events, args=(client, body, first, sink), daemon=True)
        t.start()
        streams.append((first, sink))
        threads.append(t)
    for first, _ in streams:
        assert first.wait(30), "no stream started"
    # A non-streaming request in flight too.
    plain: list = []
    t_plain = threading.Thread(target=lambda: plain.append(client.post(
        "/v1/completions", json={**body, "stream": False})), daemon=True)
    t_plain.start()
    time.sleep(0.2)

    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads + [t_plain]:
        t.join(20)
        assert not t.is_alive(), "a request hung after the engine core died"
    assert time.monotonic() - t0 < 20
    for _, sink in streams:
        assert sink[0] == 200
        payloads = [line.removeprefix("data: ") for line in sink[1:]]
        assert payloads[-1] == "[DONE]"
        err = json.loads(payloads[-2])["error"]
        assert err["code"] == "engine_dead" and "engine" in err["message"]
        assert not any(json.loads(p).get("choices", [{}])[0].get("finish_reason") == "length"
                       for p in payloads[:-2])  # they were cut short, not finished
    assert plain and plain[0].status_code == 500 and plain[0].json()["error"]["code"] == "engine_dead"

    deadline = time.monotonic() + 5
    while httpx.get(server.url("/health"), timeout=5).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(server.url("/health"), timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    late = client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4})
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    for route in ("/v1/diagnostics", "/v1/kv_events"):  # these once waited forever after the core died
        r = client.get(route, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", (route, r.text)
    client.close()
    assert server.proc.poll() is None  # the HTTP server itself stays up to say so
    assert server.stop(signal.SIGTERM) is not None
