"""`tokenmill serve --data-parallel-size 2`: two engine cores behind one endpoint give a single engine's
greedy output (streamed and not, n > 1, logprobs), both replicas take requests, and a replica that dies
fails only its own requests while the other keeps serving."""
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

pytestmark = pytest.mark.timeout(240)
PROMPTS = ["The quick brown fox", "SELECT * FROM users", "hello", "Once upon a time there was"]


def completions(srv, prompt: str, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2, **kw}
    r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_text(srv, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(text)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("dp") / "llama", "llama", hidden_size=128,
                           intermediate_size=256, num_hidden_layers=4, max_position_embeddings=4096)
    common = ("--served-model-name", "tiny", "--kv-cache-memory-bytes", "32M", "--max-model-len", "4096")
    one = start_server(path, path.parent / "one.log", *common)
    two = start_server(path, path.parent / "two.log", *common, "--data-parallel-size", "2")
    yield one, two
    one.stop(signal.SIGKILL)
    two.stop(signal.SIGKILL)


def test_dp2_output_equals_one_engine(servers):
    one, two = servers
    for p in PROMPTS:
        a, b = completions(one, p), completions(two, p)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        la, lb = a["choices"][0]["logprobs"]["token_logprobs"], b["choices"][0]["logprobs"]["token_logprobs"]
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
        assert streamed_text(two, p) == a["choices"][0]["text"]
    a, b = completions(one, PROMPTS[0], n=2), completions(two, PROMPTS[0], n=2)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]


def test_both_replicas_serve_concurrent_requests(servers):
    _, two = servers
    threads = [threading.Thread(target=completions, args=(two, p), kwargs={"max_tokens": 24}) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    d = httpx.get(two.url("/v1/diagnostics"), timeout=30).json()
    assert len(d["replicas"]) == 2
    assert all(r["steps"] > 0 for r in d["replicas"])


def test_a_dead_replica_fails_only_its_requests(servers):
    _, two = servers
    cores = spawned_children(two.proc.pid)
    assert len(cores) == 2, cores
    results: list = []

    def run(p):  # long enough (thousands of tokens) to be running when the replica is killed
        body = {"model": "tiny", "prompt": p, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        try:
            results.append(httpx.post(two.url("/v1/completions"), json=body, timeout=120).status_code)
        except httpx.HTTPError as e:
            results.append(repr(e))

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # both replicas are generating
        d = httpx.get(two.url("/metrics"), timeout=10).text
        running = sum(float(line.split()[-1]) for line in d.splitlines()
                      if line.startswith("tokenmill:num_requests_running{"))
        if running >= len(PROMPTS):
            break
        time.sleep(0.05)
    os.kill(cores[-1], signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a request hung after a replica died"
    assert time.monotonic() - t0 < 120
    assert len(results) == len(PROMPTS) and all(isinstance(r, int) for r in results), results
    assert 200 in results and any(r >= 500 for r in results), results  # one replica's requests failed
    assert httpx.get(two.url("/health"), timeout=5).status_code == 200  # the other still serves
    assert completions(two, "hello")["choices"][0]["text"]
