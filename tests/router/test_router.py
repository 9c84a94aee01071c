"""tokenmill router: policies as pure units, the app against fake backends (proxying, retry, broken
streams, health), and one end-to-end run over two real tiny `tokenmill serve` processes."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from fake_openai_server import FakeConfig, FakeServer
from server_harness import free_port, serve_in_thread
from tokenmill.core.kv_cache import hash_block
from tokenmill.router.app import RouterConfig, create_app
from tokenmill.router.cache_index import CacheIndex, prompt_hashes
from tokenmill.router.policies import LeastLoad, PrefixAware, RoundRobin, make_policy


# ---- policies --------------------------------------------------------------------------------
def test_round_robin_cycles_in_order():
    p = RoundRobin()
    assert [p.choose(["a", "b", "c"], {}) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_load_picks_fewest_outstanding_tokens():
    assert LeastLoad().choose(["a", "b", "c"], {"a": 50, "b": 10, "c": 30}) == "b"
    p = LeastLoad()
    assert [p.choose(["a", "b"], {"a": 0, "b": 0}) for _ in range(4)] == ["a", "b", "a", "b"]  # ties take turns


def test_prefix_aware_prefers_longest_cached_prefix():
    p = PrefixAware(balance_abs=100, balance_rel=1.5)
    load = {"a": 10, "b": 50, "c": 0}
    assert p.choose(["a", "b", "c"], load, {"a": 2, "b": 5, "c": 0}) == "b"
    assert p.choose(["a", "b", "c"], load, {"a": 0, "b": 0, "c": 0}) == "c"  # no match: least load
    assert p.choose(["a", "b", "c"], load, {"a": 3, "b": 3}) == "a"  # equal match: the lighter
    assert {p.choose(["a", "b"], {}, {"a": 0, "b": 0}) for _ in range(2)} == {"a", "b"}


def test_prefix_aware_falls_back_to_least_load_when_holder_is_overloaded():
    p = PrefixAware(balance_abs=100, balance_rel=1.5)
    assert p.choose(["a", "b"], {"a": 1000, "b": 10}, {"a": 8, "b": 0}) == "b"
    assert p.choose(["a", "b"], {"a": 100, "b": 10}, {"a": 8, "b": 0}) == "a"  # within the absolute margin
    assert p.choose(["a", "b"], {"a": 1200, "b": 1000}, {"a": 8, "b": 0}) == "a"  # within the factor


def test_make_policy_rejects_unknown():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_cache_index_follows_events_and_reset():
    ids = list(range(40))
    hashes = prompt_hashes(ids, 16)
    assert len(hashes) == 2 and hashes[1] == hash_block(hashes[0], ids[16:32])
    idx = CacheIndex(["a"])
    idx.apply("a", {"block_size": 16, "last_seq": 1, "reset": False, "events": [[1, "stored", hashes[0].hex()]]})
    assert idx.matched("a", hashes) == 1 and idx.block_size == 16
    idx.apply("a", {"last_seq": 3, "reset": False,
                    "events": [[2, "stored", hashes[1].hex()], [3, "removed", hashes[0].hex()]]})
    assert idx.matched("a", hashes) == 0  # a hole at the start: nothing usable
    idx.apply("a", {"last_seq": 9, "reset": True, "events": [], "stored": [h.hex() for h in hashes]})
    assert idx.matched("a", hashes) == 2 and idx.caches["a"].last_seq == 9


# ---- the app over fake backends --------------------------------------------------------------
@contextmanager
def router(backends: list[str], **kw):
    """The router app served by uvicorn in a thread; yields its base URL."""
    cfg = RouterConfig(backends=backends, **{"health_interval_s": 0.1, "connect_timeout_s": 1.0, **kw})
    app = create_app(cfg)
    with serve_in_thread(app) as url:
        yield url, app.state.router


def fake(**kw) -> FakeServer:
    return FakeServer(FakeConfig(ttft_s=0.01, itl_s=0.005, honor_stream=True, **kw))


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_proxies_completions_and_chat_streamed_and_not():
    with fake() as a, fake() as b, router([a.url, b.url]) as (url, r):
        body = {"model": "fake-model", "prompt": "hello there", "max_tokens": 3}
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == " tok" * 3
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        got = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=10)
        assert got.json()["choices"][0]["message"]["content"] == " tok" * 2
        for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            with httpx.stream("POST", url + path, json={**req, "stream": True}, timeout=10) as s:
                assert s.headers["content-type"].startswith("text/event-stream")
                events = sse_events(s.read().decode())
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        assert len(a.cfg.requests_seen) == len(b.cfg.requests_seen) == 2  # round robin
        models = httpx.get(f"{url}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "fake-model"
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert f'tokenmill:router_requests_total{{backend="{a.url}"}} 2.0' in metrics
        assert 'tokenmill:router_in_flight_tokens{backend=' in metrics
        assert all(be.load == 0 and be.in_flight == 0 for be in r.backends.values())


def test_retries_once_on_another_backend_before_any_byte():
    with fake(fail_status=503) as bad, fake() as good, router([bad.url, good.url]) as (url, r):
        for stream in (False, True):
            got = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream},
                             timeout=10)
            assert got.status_code == 200
        assert len(good.cfg.requests_seen) == 2
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert f'tokenmill:router_retries_total{{backend="{bad.url}"}}' in metrics
        assert f'tokenmill:router_errors_total{{backend="{bad.url}"}} 0.0' not in metrics


def test_retries_when_a_backend_refuses_connections():
    dead = f"http://127.0.0.1:{free_port()}"
    with fake() as good, router([dead, good.url], health_interval_s=60) as (url, r):
        r.backends[dead].healthy = True  # as if it died just after a health check
        got = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert got.status_code == 200 and len(good.cfg.requests_seen) == 1
        assert not r.backends[dead].healthy  # left the rotation at once


def test_broken_stream_ends_with_error_event_and_done_without_retry():
    with fake() as a, fake() as b, router([a.url, b.url]) as (url, r):
        with httpx.stream("POST", f"{url}/v1/completions",
                          json={"prompt": "BREAKSTREAM now", "max_tokens": 5, "stream": True}, timeout=10) as s:
            events = sse_events(s.read().decode())
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "message" in err
        assert json.loads(events[0])["choices"][0]["text"] == " tok"
        assert len(a.cfg.requests_seen) + len(b.cfg.requests_seen) == 1  # no duplicate
        assert wait_until(lambda: all(be.load == 0 for be in r.backends.values()))


def test_dead_backend_leaves_rotation_and_rejoins():
    a = fake()
    a.__enter__()
    port = int(a.url.rsplit(":", 1)[1])
    with fake() as b, router([a.url, b.url]) as (url, r):
        a.__exit__(None, None, None)
        assert wait_until(lambda: not r.backends[a.url].healthy)
        for _ in range(4):
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              timeout=10).status_code == 200
        assert len(b.cfg.requests_seen) == 4
        with FakeServer(FakeConfig(ttft_s=0.01, itl_s=0.005), port=port) as a2:
            assert wait_until(lambda: r.backends[a.url].healthy)
            for _ in range(2):
                httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
            assert len(a2.cfg.requests_seen) == 1


def test_unhealthy_backends_answer_503_in_openai_shape():
    with fake() as a, router([a.url]) as (url, r):
        a.cfg.healthy = False
        assert wait_until(lambda: not r.backends[a.url].healthy)
        got = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert got.status_code == 503
        assert set(got.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        assert a.cfg.requests_seen == []
        a.cfg.healthy = True
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)


# ---- end to end over two real tokenmill servers -----------------------------------------------
@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    from server_harness import start_server
    from tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("router_llama"), "llama")
    logs = tmp_path_factory.mktemp("router_logs")
    args = ("--block-size", "4", "--enable-prefix-caching", "--kv-cache-memory-bytes", "4M",
            "--no-engine-core-process")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_server, model, logs / f"s{i}.log", *args) for i in range(2)]
        servers = [f.result() for f in futures]
    yield model, servers
    for s in servers:
        s.stop()


def test_prefix_aware_sends_repeated_prompt_to_the_backend_that_cached_it(two_servers):
    model, servers = two_servers
    urls = [s.base_url for s in servers]
    prompts = ["The quick brown fox jumps over the lazy dog. " * 6,
               "Paged attention stores keys and values in fixed-size blocks. " * 5]
    bodies = [{"model": str(model), "prompt": p, "max_tokens": 2, "temperature": 0} for p in prompts]

    def stored(u: str) -> set[str]:
        return {e[2] for e in httpx.get(f"{u}/v1/kv_events", timeout=5).json()["events"] if e[1] == "stored"}

    def requests_by_backend(url: str) -> dict[str, float]:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        return {u: float(line.split()[-1]) for u in urls for line in text.splitlines()
                if line.startswith(f'tokenmill:router_requests_total{{backend="{u}"}}')}

    with router(urls, policy="prefix-aware", tokenizer=str(model), poll_interval_s=0.05) as (url, r):
        home = []
        for body in bodies:  # no cache anywhere yet: idle ties take turns, one prompt per backend
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            hashes = prompt_hashes(r.prompts.token_ids(body), 4)
            holders = [u for u in urls if {h.hex() for h in hashes} <= stored(u)]
            assert len(holders) == 1
            home.append(holders[0])
            assert wait_until(lambda: r.cache.matched(home[-1], hashes) == len(hashes))
        assert home[0] != home[1]
        for body in bodies:  # (taking turns would now send each prompt to both backends)
            for _ in range(3):
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        assert requests_by_backend(url) == {home[0]: 4.0, home[1]: 4.0}
        text = httpx.get(f"{url}/metrics", timeout=5).text
        hit = sum(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("tokenmill:router_prefix_hit_tokens_total"))
        assert hit > 0

    with router(urls, policy="round-robin") as (url, r):
        for _ in range(4):  # the same prompt alternates, cache or not
            assert httpx.post(f"{url}/v1/completions", json=bodies[0], timeout=60).status_code == 200
        assert requests_by_backend(url) == {urls[0]: 2.0, urls[1]: 2.0}


def test_a_replica_killed_under_load_fails_or_completes_each_request_once_and_rejoins(two_servers, tmp_path):
    """Requests through the router while one real replica is killed: none hangs, each completes (once) or
    gets an error; the dead replica leaves the rotation, and a server started again on its port rejoins."""
    import signal

    from server_harness import start_server

    model, servers = two_servers
    urls = [s.base_url for s in servers]
    body = {"model": str(model), "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}
    victim = servers[1]
    results: list = []

    def send(i: int) -> None:
        try:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": f"{i} {body['prompt']}"}, timeout=60)
            results.append((r.status_code, len(r.json()["choices"]) if r.status_code == 200 else 0))
        except httpx.HTTPError as e:
            results.append((repr(e), 0))

    with router(urls, policy="least-load") as (url, r):
        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        for t in threads:
            t.join(90)
            assert not t.is_alive(), "a request hung"
        assert len(results) == 8
        assert all(code == 200 and n == 1 or isinstance(code, int) and code >= 500 for code, n in results), results
        assert sum(code == 200 for code, _ in results) >= 4
        assert wait_until(lambda: not r.backends[urls[1]].healthy, 10)
        # Everything now goes to the survivor.
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        port = int(urls[1].rsplit(":", 1)[1])
        again = start_server(model, tmp_path / "again.log", "--block-size", "4", "--kv-cache-memory-bytes", "4M",
                             "--no-engine-core-process", port=port)
        try:
            assert wait_until(lambda: r.backends[urls[1]].healthy, 15), "the restarted replica did not rejoin"
            for _ in range(4):  # and takes requests again
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            assert r.backends[urls[1]].healthy
        finally:
            again.stop()
            servers[1] = again


# ---- disaggregated prefill/decode -------------------------------------------------------------------
def test_pd_through_the_router_equals_one_engine(tmp_path):
    """router --pd: a prefill instance (kv_producer) computes each prompt for one token and writes its
    blocks; the decode instance (kv_consumer) loads them and decodes. Text, logprobs, streaming and n=2 equal
    a normal engine's (the producer serving the request itself)."""
    from server_harness import start_server
    from tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama", seed=8)
    shared = tmp_path / "kv"
    common = ("--block-size", "4", "--kv-cache-memory-bytes", "8M", "--no-engine-core-process")

    def role(r: str) -> tuple[str, ...]:
        return ("--kv-transfer-config", json.dumps({"kv_role": r, "kv_connector_extra_config":
                                                    {"shared_storage_path": str(shared)}}))

    with ThreadPoolExecutor(2) as pool:
        fp = pool.submit(start_server, model, tmp_path / "prefill.log", *common, *role("kv_producer"))
        fd = pool.submit(start_server, model, tmp_path / "decode.log", *common, *role("kv_consumer"))
        producer, consumer = fp.result(), fd.result()
    try:
        with router([consumer.base_url], policy="round-robin", prefill=[producer.base_url]) as (url, r):
            for i, kw in enumerate([{}, {"n": 2}, {"stream": True}]):
                prompt = f"{i} The quick brown fox jumps over the lazy dog. " * 4
                body = {"model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1,
                        **kw}
                if kw.get("stream"):
                    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
                    assert events[-1] == "[DONE]"
                    got = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
                    ref = httpx.post(producer.url("/v1/completions"), json={**body, "stream": False}, timeout=60)
                    assert got == ref.json()["choices"][0]["text"]
                    continue
                pd = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
                ref = httpx.post(producer.url("/v1/completions"), json=body, timeout=60).json()
                assert [c["text"] for c in pd["choices"]] == [c["text"] for c in ref["choices"]]
                for a, b in zip(pd["choices"], ref["choices"]):
                    la, lb = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
                    assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
        text = httpx.get(consumer.url("/metrics"), timeout=5).text
        imported = sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("tokenmill:kv_transfer_blocks_total") and 'direction="imported"' in line)
        assert imported >= 3 * 10  # each prompt's full blocks came from the prefill instance
        assert "tokenmill:kv_transfer_bytes_total" in text
    finally:
        producer.stop()
        consumer.stop()


# ---- tenants at the router -----------------------------------------------------------------------------------
ROUTER_KEYS = """
tenants:
  - name: team-a
    keys: ["sk-a"]
    priority: 2
    slo: {ttft_ms: 500}
  - name: team-b
    keys: ["sk-b"]
    models: ["other-*"]
  - name: team-c
    keys: ["sk-c"]
    limits: {requests_per_minute: 2}
"""


def test_tenants_at_the_router_hold_over_every_backend(tmp_path):
    """--api-keys-file on the router: keys, model access, limits counted once for all backends, the tenant's
    priority and SLO passed on, the backends called with the router's key, usage metered from the backends'
    answers (a stream's usage chunk kept from a client that did not ask for it), per-tenant counters."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(ROUTER_KEYS)
    db = tmp_path / "usage.db"
    with fake(api_key="sk-backend") as a, fake(api_key="sk-backend") as b, \
            router([a.url, b.url], api_keys_file=str(keys), admin_key="sk-admin", usage_db=str(db),
                   backend_api_key="sk-backend") as (url, r):
        def post(key, body, stream=False):
            headers = {"Authorization": f"Bearer {key}"}
            if stream:
                with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers,
                                  timeout=10) as s:
                    return s.status_code, sse_events(s.read().decode())
            return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)

        body = {"model": "fake-model", "prompt": "one two three four", "max_tokens": 3}
        assert post("sk-nope", body).status_code == 401
        assert post("sk-b", body).json()["error"]["code"] == "model_not_found"
        assert post("sk-a", body).json()["usage"]["completion_tokens"] == 3
        code, events = post("sk-a", body, stream=True)  # no include_usage: the usage chunk stays at the router
        assert code == 200 and not any('"usage"' in e for e in events) and events[-1] == "[DONE]"
        code, events = post("sk-a", {**body, "stream_options": {"include_usage": True}}, stream=True)
        assert any('"usage"' in e for e in events)
        seen = a.cfg.requests_seen + b.cfg.requests_seen
        assert len(seen) == 3 and set(a.cfg.keys_seen + b.cfg.keys_seen) == {"Bearer sk-backend"}
        assert all(s["priority"] == 2 and s["slo"] == {"ttft_ms": 500} for s in seen)
        assert all(s["stream_options"] == {"include_usage": True} for s in seen if s.get("stream"))
        # team-c: two a minute over both backends together (round robin sends them to different ones)
        codes = [post("sk-c", body).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        listed = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-b"}, timeout=5).json()["data"]
        assert listed == []
        rows = httpx.get(f"{url}/v1/usage", params={"group_by": "tenant"}, headers={"Authorization": "Bearer sk-admin"},
                         timeout=10).json()["data"]
        got = {row["tenant"]: (row["requests"], row["prompt_tokens"], row["completion_tokens"], row["errors"])
               for row in rows}
        assert got == {"team-a": (3, 12, 9, 0), "team-b": (1, 0, 0, 1), "team-c": (3, 8, 6, 1)}
        assert httpx.get(f"{url}/v1/usage", params={"tenant": "team-a"}, headers={"Authorization": "Bearer sk-c"},
                         timeout=10).status_code == 403
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-admin"}, timeout=5).text  # internal
        assert 'tokenmill:router_tenant_requests_total{outcome="ok",tenant="team-a"} 3.0' in metrics
        keys.write_text(ROUTER_KEYS + '  - name: team-d\n    keys: ["sk-d"]\n')
        assert httpx.post(f"{url}/admin/reload", headers={"Authorization": "Bearer sk-admin"}, timeout=10).json()[
            "tenants"] == ["team-a", "team-b", "team-c", "team-d"]
        assert post("sk-d", body).status_code == 200
