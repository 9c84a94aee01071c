"""Tenants: the keys file (YAML or JSON, hashed keys, refused whole with the reason), per-tenant model access,
priority class and admission limits (concurrent requests, requests per minute: 429 + Retry-After), the admin
key, and reloading the keys on POST /admin/reload and SIGHUP without dropping requests."""
from __future__ import annotations

import hashlib
import json
import signal
import time

import httpx
import pytest

from server_harness import start_server
from tiny import make_tiny_model
from tokenmill.core.request import RequestSLO
from tokenmill.serve.tenants.keys import KeysFileError, Tenant, TenantLimits, load_keys, priority_for, slo_for
from tokenmill.serve.tenants.limits import TenantLimiter

YAML = """
tenants:
  - name: team-a
    keys: ["sk-a-1", "sha256:{digest}"]
    models: ["base"]
    limits: {{requests_per_minute: 3, concurrent: 1}}
    priority: 2
    slo: {{ttft_ms: 1000, tpot_ms: 100}}
  - name: team-b
    keys: ["sk-b"]
  - name: team-x
    keys: ["sk-x"]
    models: ["sql-*"]
  - name: team-t
    keys: ["sk-t"]
    limits: {{tokens_per_minute: 60, tokens_per_day: 45}}
  - name: team-s
    keys: ["sk-s"]
    slo: {{ttft_ms: 0.001}}
  - name: team-q
    keys: ["sk-q"]
    limits: {{tokens_per_minute: 100}}
  - name: team-n
    keys: ["sk-n"]
    limits: {{concurrent: 2, requests_per_minute: 5}}
  - name: team-z
    keys: ["sk-z"]
    limits: {{tokens_per_day: 2000}}
"""


def write_yaml(path, extra: str = "") -> None:
    path.write_text(YAML.format(digest=hashlib.sha256(b"sk-a-2").hexdigest()) + extra)


async def completion_status(guard, key: str) -> int:
    """The status a GuardMiddleware answers a POST /v1/completions with `key` (an empty body)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"authorization", f"Bearer {key}".encode())]}
    await guard(scope, receive, send)
    return sent[0]["status"]


# ---- the file -------------------------------------------------------------------------------------------------
def test_yaml_and_json_files_and_hashed_keys(tmp_path):
    p = tmp_path / "keys.yaml"
    write_yaml(p)
    table = load_keys(str(p))
    a = table.lookup("sk-a-1")
    assert a is not None and a.name == "team-a" and table.lookup("sk-a-2") is a  # the hashed key
    assert a.limits == TenantLimits(requests_per_minute=3, concurrent=1) and a.priority == 2
    assert a.slo.ttft_ms == 1000 and a.may_use("base") and not a.may_use("other")
    assert table.lookup("sk-b").may_use("anything") and table.lookup("sk-a-") is None and table.lookup("") is None
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"tenants": [{"name": "x", "keys": ["k"], "models": ["sql-*"]}]}))
    x = load_keys(str(j)).lookup("k")
    assert x.may_use("sql-fr") and not x.may_use("base")
    assert "sk-a-1" not in repr(table.entries)  # only digests are kept


@pytest.mark.parametrize("doc, reason", [
    ({"tenants": []}, "non-empty list `tenants`"),
    ({"tenants": [{"name": "a"}]}, "non-empty list of keys"),
    ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["k"]}]}, "given twice"),
    ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "a", "keys": ["j"]}]}, "tenant 'a' is given twice"),
    ({"tenants": [{"name": "a", "keys": ["k"], "limits": {"rpm": 3}}]}, "unknown keys"),
    ({"tenants": [{"name": "a", "keys": ["k"], "limits": {"concurrent": 0}}]}, "positive number"),
    ({"tenants": [{"name": "a", "keys": ["k"], "limits": {"concurrent": 1.5}}]}, "must be an integer"),
    ({"tenants": [{"name": "a", "keys": ["sha256:abc"]}]}, "64 hex digits"),
    ({"tenants": [{"name": "a", "keys": ["k"], "quota": 1}]}, "unknown keys"),
])
def test_bad_files_are_refused_whole_with_the_reason(tmp_path, doc, reason):
    p = tmp_path / "keys.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(KeysFileError, match=reason):
        load_keys(str(p))
    with pytest.raises(KeysFileError, match="cannot be read"):
        load_keys(str(tmp_path / "missing.yaml"))


def test_priority_class_is_the_most_urgent_a_tenant_gets():
    t = Tenant("t", priority=5)
    assert priority_for(t, 0) == 5 and priority_for(t, 9) == 9 and priority_for(None, -3) == -3


def test_a_tenant_slo_is_the_tightest_its_requests_get():
    t = Tenant("t", slo=RequestSLO(ttft_ms=500, tpot_ms=50))
    assert slo_for(t, None) == t.slo
    assert slo_for(t, RequestSLO(ttft_ms=100, tpot_ms=80)) == RequestSLO(500, 80)  # relaxed, never tightened
    assert slo_for(Tenant("batch"), RequestSLO(ttft_ms=100)) is None  # a tenant without targets runs batch work
    assert slo_for(None, RequestSLO(tpot_ms=20)) == RequestSLO(tpot_ms=20) and slo_for(None, RequestSLO()) is None


# ---- admission limits -----------------------------------------------------------------------------------------
def test_concurrent_and_per_minute_limits_with_retry_after():
    now = [0.0]
    lim = TenantLimiter(clock=lambda: now[0])
    t = Tenant("t", limits=TenantLimits(requests_per_minute=2, concurrent=2))
    assert lim.admit(t) is None and lim.admit(t) is None
    busy = lim.admit(t)
    assert busy.status == 429 and busy.code == "rate_limit_exceeded" and "in flight" in busy.message
    lim.release(t)
    lim.release(t)
    per_minute = lim.admit(t)  # two slots free, but the two requests of this minute are spent
    assert per_minute.status == 429 and per_minute.headers["Retry-After"] == "30"
    now[0] = 30.0  # half a minute refills one request
    assert lim.admit(t) is None
    assert lim.admit(Tenant("other")) is None  # another tenant's counts are its own
    assert lim.in_flight == {"t": 1, "other": 1}


def test_token_budgets_reserve_the_worst_case_and_give_back_the_rest():
    now, wall = [0.0], [86400.0 * 100 + 3600]  # one hour into a UTC day
    lim = TenantLimiter(clock=lambda: now[0], wall=lambda: wall[0])
    t = Tenant("t", limits=TenantLimits(tokens_per_minute=100, tokens_per_day=150))
    too_big = lim.reserve(t, 101, lambda: 0)
    assert too_big.status == 429 and "too large" in too_big.message
    r1 = lim.reserve(t, 80, lambda: 30)  # may use 80, will use 30
    assert not hasattr(r1, "status")
    r2 = lim.reserve(t, 30, lambda: 30)
    assert r2.status == 429 and r2.code == "rate_limit_exceeded" and r2.headers["Retry-After"] == "6"  # 10 short
    lim.settle(r1)  # 50 of the minute's tokens come back, and of the day's
    assert lim.token_buckets["t"].tokens == 70 and lim.day_used[("t", 100)] == 30
    for _ in range(4):
        assert not hasattr(lim.reserve(t, 30, lambda: 30), "status")
        now[0] += 60
    day = lim.reserve(t, 30, lambda: 30)  # 150 used today
    assert day.status == 429 and day.code == "insufficient_quota" and day.headers["Retry-After"] == str(23 * 3600)
    wall[0] += 23 * 3600  # the next UTC day
    assert not hasattr(lim.reserve(t, 30, lambda: 30), "status")


def test_limits_count_sequences_not_requests():
    """A request of prompts x n sequences takes that many slots and per-minute requests (the middleware one before
    the body, the handler the rest); one that alone exceeds a limit is told so; release gives them all back."""
    from tokenmill.serve.tenants.limits import admit_sequences

    now = [0.0]
    lim = TenantLimiter(clock=lambda: now[0])
    t = Tenant("t", limits=TenantLimits(requests_per_minute=6, concurrent=4))
    scope = {"state": {}}
    assert lim.admit(t) is None  # the middleware's one
    scope["state"]["sequences"] = 1
    admit_sequences(scope, lim, t, 3)  # 3 prompts x n=1
    assert lim.in_flight == {"t": 3} and scope["state"]["sequences"] == 3
    assert lim.admit(t) is None  # a fourth slot
    busy = lim.admit(t, 1, 1)  # a request holding one asks for one more: all 4 in flight
    assert busy.status == 429 and "4 sequences" in busy.message and busy.headers["Retry-After"] == "1"
    with pytest.raises(Exception) as e:
        admit_sequences({"state": {"sequences": 1}}, lim, t, 5)  # 5 sequences alone: above 4 in flight
    assert e.value.status == 429 and "too large" in e.value.message and "5 sequences" in e.value.message
    lim.release(t, 3)
    lim.release(t)
    assert lim.in_flight == {}
    assert lim.admit(t, 2) is None and lim.admit(t, 2) is not None  # 4 of the minute's 6 spent: 2 more than left
    now[0] = 20.0  # a third of a minute: 2 more
    assert lim.admit(t, 2) is None
    assert lim.admit(Tenant("other"), 1000) is None  # another tenant's counts are its own (and it has no limits)
    admit_sequences({"state": {}}, lim, t, 50)  # not admitted by the middleware (no tenant route): nothing taken
    assert lim.in_flight == {"t": 4, "other": 1000}


def test_usage_beyond_the_reservation_is_charged_and_refuses_until_repaid():
    now, wall = [0.0], [86400.0 * 100 + 3600]
    lim = TenantLimiter(clock=lambda: now[0], wall=lambda: wall[0])
    t = Tenant("t", limits=TenantLimits(tokens_per_minute=60, tokens_per_day=500))
    r = lim.reserve(t, 10, lambda: 100)  # reserved 10, used 100
    lim.settle(r)
    assert lim.token_buckets["t"].tokens == -40 and lim.day_used[("t", 100)] == 100  # 40 in debt
    refused = lim.reserve(t, 1, lambda: 1)
    assert refused.status == 429 and refused.headers["Retry-After"] == "41"  # 41 tokens at one a second
    now[0] = 41.0
    assert not hasattr(lim.reserve(t, 1, lambda: 1), "status")  # repaid
    assert not hasattr(lim.reserve(Tenant("u", limits=t.limits), 60, lambda: 0), "status")  # others untouched
    now[0] = 200.0
    lim.settle(lim.reserve(t, 60, lambda: 450))  # 550 used today: over the day's 500
    assert lim.day_used[("t", 100)] == 100 + 1 + 450
    now[0] = 2000.0  # the minute's debt repaid long since; the day's stays
    day = lim.reserve(t, 1, lambda: 1)
    assert day.status == 429 and day.code == "insufficient_quota"


def test_the_middleware_releases_every_sequence_the_handler_took(tmp_path):
    import asyncio

    from tokenmill.serve.middleware import GuardMiddleware
    from tokenmill.serve.tenants.keys import KeyStore, tenant_of
    from tokenmill.serve.tenants.limits import admit_sequences

    p = tmp_path / "keys.yaml"
    write_yaml(p)
    guard = GuardMiddleware(None, None, 1 << 20, keys=KeyStore(str(p)))
    seen = []

    async def app(scope, receive, send):
        try:
            admit_sequences(scope, guard.limiter, tenant_of(scope), 2)  # e.g. 2 prompts
        except Exception as e:
            return await e.response()(scope, receive, send)
        seen.append(dict(guard.limiter.in_flight))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard.app = app

    def call(key: str):
        return completion_status(guard, key)

    assert asyncio.run(call("sk-b")) == 200 and seen == [{"team-b": 2}]
    assert asyncio.run(call("sk-a-1")) == 429  # team-a: one in flight, and this request is two
    assert guard.limiter.in_flight == {}


# ---- the server -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    base = make_tiny_model(root / "base", "llama")
    keys = root / "keys.yaml"
    write_yaml(keys)
    srv = start_server(base, root / "server.log", "--served-model-name", "base", "other", "--api-keys-file",
                       str(keys), "--admin-key", "sk-admin", "--api-key", "sk-legacy",
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", "256",
                       "--scheduling-policy", "slo", "--slo-shed", "--usage-db", str(root / "usage.db"))
    yield srv, keys
    assert srv.stop() == 0, srv.log()


def post(srv, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.url(path), json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def completion(model: str = "base", **kw) -> dict:
    return {"model": model, "prompt": "The quick", "max_tokens": 2, **kw}


def test_keys_and_model_access(server):
    srv, _ = server
    assert post(srv, "sk-nope", completion()).status_code == 401
    assert post(srv, "sk-b", completion("other")).status_code == 200
    assert post(srv, "sk-legacy", completion("other")).status_code == 200  # --api-key: every model, no limits
    assert post(srv, "sk-a-2", completion("other")).status_code == 200  # another name of the base model
    r = post(srv, "sk-x", completion("base"))  # team-x may use sql-* adapters only
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(srv, "sk-x", {"model": "base", "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    assert r.status_code == 404
    listed = lambda key: [m["id"] for m in httpx.get(  # noqa: E731
        srv.url("/v1/models"), headers={"Authorization": f"Bearer {key}"}, timeout=10).json()["data"]]
    assert listed("sk-x") == [] and listed("sk-a-1") == ["base", "other"]
    assert httpx.get(srv.url("/v1/models/base"), headers={"Authorization": "Bearer sk-x"},
                     timeout=10).status_code == 404


def test_requests_per_minute_answer_429_and_other_tenants_go_on(server):
    srv, _ = server
    codes = [post(srv, "sk-a-1", completion()).status_code for _ in range(4)]  # 3 a minute (one spent before)
    assert codes[0] == 200 and codes[-1] == 429, codes
    r = post(srv, "sk-a-2", completion())  # another key of the same tenant shares its limits
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["Retry-After"]) >= 1
    assert post(srv, "sk-b", completion()).status_code == 200  # other tenants are not held up


def test_concurrent_limit_holds_until_the_response_is_done(tmp_path):
    """The middleware around an app that answers only when told: a tenant's second request in flight is
    refused, a free slot admits again, and a request the client abandons gives its slot back."""
    import asyncio

    from tokenmill.serve.middleware import GuardMiddleware
    from tokenmill.serve.tenants.keys import KeyStore

    p = tmp_path / "keys.yaml"
    write_yaml(p)
    gate = asyncio.Event()

    async def app(scope, receive, send):
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = GuardMiddleware(app, None, 1 << 20, keys=KeyStore(str(p)))

    def call(key: str):
        return completion_status(guard, key)

    async def main():
        first = asyncio.ensure_future(call("sk-a-1"))
        await asyncio.sleep(0)
        assert await call("sk-a-2") == 429  # team-a allows one in flight
        other = asyncio.ensure_future(call("sk-b"))
        await asyncio.sleep(0)
        gate.set()
        assert await first == 200 and await other == 200
        assert guard.limiter.in_flight == {}
        gate.clear()
        abandoned = asyncio.ensure_future(call("sk-a-1"))
        await asyncio.sleep(0)
        abandoned.cancel()  # the client went away mid-request
        await asyncio.gather(abandoned, return_exceptions=True)
        assert guard.limiter.in_flight == {}

    asyncio.run(main())


def test_token_budgets_on_the_server(server):
    srv, _ = server
    r = post(srv, "sk-t", completion(max_tokens=100))  # worst case above the 60 a minute
    assert r.status_code == 429 and "too large" in r.json()["error"]["message"]
    first = post(srv, "sk-t", completion(max_tokens=12, ignore_eos=True))
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    codes = [post(srv, "sk-t", completion(max_tokens=12, ignore_eos=True)).status_code for _ in range(3)]
    # 45 a day: what the requests really used counts, so exactly floor(45 / used) of them run
    assert codes.count(200) == 45 // used - 1, (codes, used)
    r = post(srv, "sk-t", completion(max_tokens=12, ignore_eos=True))
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"


def test_admin_routes_and_reload(server):
    srv, keys = server
    assert post(srv, "sk-b", {}, "/admin/reload").status_code == 403
    write_yaml(keys, '  - name: team-c\n    keys: ["sk-c"]\n')
    r = post(srv, "sk-admin", {}, "/admin/reload")
    assert r.status_code == 200 and r.json()["tenants"] == ["team-a", "team-b", "team-c", "team-n", "team-q", "team-s",
                                                            "team-t", "team-x", "team-z"]
    assert post(srv, "sk-c", completion()).status_code == 200
    keys.write_text("tenants: [")  # broken: refused, the old keys stay
    r = post(srv, "sk-admin", {}, "/admin/reload")
    assert r.status_code == 400 and "old keys stay" in r.json()["error"]["message"]
    assert post(srv, "sk-c", completion()).status_code == 200
    # SIGHUP reloads too: team-c gone, team-d in.
    write_yaml(keys, '  - name: team-d\n    keys: ["sk-d"]\n')
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while post(srv, "sk-d", completion()).status_code != 200:
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.05)
    assert post(srv, "sk-c", completion()).status_code == 401


def test_slo_of_tenant_and_request_reach_the_scheduler(server):
    """team-s's 0.001 ms TTFT cannot be met: --slo-shed answers 503 + Retry-After; a request that relaxes it
    runs; a bad target is the caller's 400."""
    srv, _ = server
    r = post(srv, "sk-s", completion())
    assert r.status_code == 503 and r.json()["error"]["code"] == "slo_unattainable", r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert post(srv, "sk-s", completion(slo={"ttft_ms": 60_000})).status_code == 200
    r = post(srv, "sk-b", completion(slo={"ttft_ms": -1}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "slo.ttft_ms"
    assert post(srv, "sk-b", completion(slo={"ttft_ms": 60_000, "tpot_ms": 60_000})).status_code == 200


def test_reloading_keys_under_load_drops_no_request(server):
    """Streams in flight while the keys file is reloaded five times (each time adding a tenant) all finish
    whole; new keys work as soon as the reload answers."""
    import threading

    srv, keys = server
    results: list[tuple[int, int]] = []

    def stream(key: str) -> None:
        body = completion(max_tokens=24, ignore_eos=True, stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
            results.append((s.status_code, events[-1]["usage"]["completion_tokens"], finish))

    threads = [threading.Thread(target=stream, args=("sk-b" if i % 2 else "sk-legacy",)) for i in range(8)]
    for t in threads:
        t.start()
    for i in range(5):
        write_yaml(keys, f'  - name: team-r{i}\n    keys: ["sk-r{i}"]\n')
        assert post(srv, "sk-admin", {}, "/admin/reload").status_code == 200
        assert post(srv, f"sk-r{i}", completion()).status_code == 200
    for t in threads:
        t.join(60)
    assert results == [(200, 24, ["length"])] * 8
    write_yaml(keys)
    assert post(srv, "sk-admin", {}, "/admin/reload").status_code == 200


ADMIN = {"Authorization": "Bearer sk-admin"}  # /metrics names the tenants: internal callers and the admin only


def test_tenant_counters_in_prometheus(server):
    srv, _ = server
    before = httpx.get(srv.url("/metrics"), headers=ADMIN, timeout=10).text
    r = post(srv, "sk-b", completion(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200
    text = httpx.get(srv.url("/metrics"), headers=ADMIN, timeout=10).text

    def value(t: str, name: str, labels: str) -> float:
        for line in t.splitlines():
            if line.startswith(f"tokenmill:{name}{{") and all(x in line for x in labels.split(",")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    ok = 'tenant="team-b",outcome="ok"'
    assert value(text, "tenant_requests_total", ok) == value(before, "tenant_requests_total", ok) + 1
    assert (value(text, "tenant_generation_tokens_total", 'tenant="team-b"')
            - value(before, "tenant_generation_tokens_total", 'tenant="team-b"')) == 3
    codes = [post(srv, "sk-a-1", completion()).status_code for _ in range(4)]  # team-a: 3 a minute
    assert 429 in codes
    text = httpx.get(srv.url("/metrics"), headers=ADMIN, timeout=10).text
    assert value(text, "tenant_requests_total", 'tenant="team-a",outcome="http_429"') >= 1


def test_tenant_label_values_are_bounded():
    from tokenmill.serve.metrics import ServerMetrics
    from tokenmill.serve.tenants.counters import MAX_TENANT_LABELS

    m = ServerMetrics("m")
    for i in range(MAX_TENANT_LABELS + 10):
        m.tenants.record(f"t{i}", 5, 0, 1, None)
    text = m.render().decode()
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("tokenmill:tenant_requests_total{")}
    assert len(tenants) == MAX_TENANT_LABELS + 1 and "other" in tenants
    other = [line for line in text.splitlines()
             if line.startswith("tokenmill:tenant_requests_total{") and 'tenant="other"' in line]
    assert len(other) == 1 and other[0].endswith(" 10.0")


def test_a_token_quota_holds_at_its_boundary_with_concurrent_clients(server):
    """Twelve clients at once against 100 tokens a minute: what the admitted ones use never passes the budget
    (each reserved its worst case before it ran), and as many run as the worst cases allow."""
    from concurrent.futures import ThreadPoolExecutor

    srv, _ = server
    body = completion(max_tokens=10, ignore_eos=True)
    t0 = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: post(srv, "sk-q", body), range(12)))
    allowed = 100 + 100 * (time.monotonic() - t0) / 60  # the bucket refills continuously meanwhile
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(refused) == 12 and refused
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    worst = ok[0].json()["usage"]["total_tokens"]  # ignore_eos: each used its worst case
    assert sum(r.json()["usage"]["total_tokens"] for r in ok) <= allowed
    assert 100 // worst <= len(ok) <= allowed // worst


def _finished(srv, tenant: str) -> float:
    """Requests of `tenant` the server has finished and metered (its Prometheus counters, every outcome)."""
    text = httpx.get(srv.url("/metrics"), headers={"Authorization": "Bearer sk-admin"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokenmill:tenant_requests_total{") and f'tenant="{tenant}"' in line)


def _used(srv, key: str) -> int:
    rows = httpx.get(srv.url("/v1/usage"), params={"group_by": "tenant"}, headers={"Authorization": f"Bearer {key}"},
                     timeout=30).json()["data"]
    return sum(row["prompt_tokens"] + row["completion_tokens"] for row in rows)


def _batch_of(worst: int, max_model_len: int = 256) -> list[list[int]]:
    """Token-id prompts whose worst case with max_tokens=1 is exactly `worst` (>= 2)."""
    k = -(-worst // max_model_len)
    size, extra = divmod(worst - k, k)
    return [[5] * (size + (i < extra)) for i in range(k)]


def test_sequences_limits_on_the_server(server):
    """team-n: 2 sequences in flight, 5 a minute. A batch or n beyond them is refused saying why."""
    srv, _ = server
    r = post(srv, "sk-n", completion(prompt=["a", "b", "c"]))
    assert r.status_code == 429 and "3 sequences" in r.json()["error"]["message"]
    r = post(srv, "sk-n", {"model": "base", "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 1},
             "/v1/chat/completions")
    assert r.status_code == 429 and "3 sequences" in r.json()["error"]["message"]
    assert post(srv, "sk-n", completion(prompt=["a", "b"])).status_code == 200  # 2 of the minute's 5 (+2 above)
    r = post(srv, "sk-n", completion(n=2))
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"


def test_quota_bypass_attempts_on_the_server(server):
    """team-z has 2000 tokens a day. 50 concurrent requests at the boundary, of the shapes that could slip past a
    reservation (a batch and n with max_tokens unset, echo with logprobs, streams the client leaves mid-way,
    chat with n): served tokens never pass the quota, and what the server charged equals what it metered to the
    token: a request that may use one token more than is left is refused, one that may use exactly what is
    left runs, and then nothing more does."""
    from concurrent.futures import ThreadPoolExecutor

    srv, _ = server
    before = _finished(srv, "team-z")

    def aborted_stream():
        body = completion(max_tokens=None, ignore_eos=True, stream=True)
        with httpx.stream("POST", srv.url("/v1/completions"), json=body, headers={"Authorization": "Bearer sk-z"},
                          timeout=60) as s:
            if s.status_code == 200:
                events = 0
                for line in s.iter_lines():
                    events += line.startswith("data: {")
                    if events == 2:
                        break  # the client leaves mid-stream
            return s.status_code

    shapes = [
        lambda: post(srv, "sk-z", completion(prompt=["The quick", "brown fox", "jumps"], max_tokens=None,
                                             ignore_eos=True)).status_code,
        lambda: post(srv, "sk-z", completion(n=4, max_tokens=None, ignore_eos=True)).status_code,
        lambda: post(srv, "sk-z", completion(echo=True, logprobs=2, max_tokens=8, ignore_eos=True)).status_code,
        aborted_stream,
        lambda: post(srv, "sk-z", {"model": "base", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                                   "max_tokens": 30, "ignore_eos": True}, "/v1/chat/completions").status_code,
    ]
    with ThreadPoolExecutor(50) as pool:
        codes = list(pool.map(lambda i: shapes[i % len(shapes)](), range(50)))
    assert set(codes) == {200, 429}, codes

    def settled(requests: int) -> None:  # aborted streams settle when the server sees the client gone
        deadline = time.monotonic() + 60
        while _finished(srv, "team-z") < before + requests:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    settled(50)
    used = _used(srv, "sk-z")
    assert used <= 2000
    left = 2000 - used
    r = post(srv, "sk-z", {"model": "base", "prompt": _batch_of(left + 1), "max_tokens": 1, "ignore_eos": True})
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    if left >= 2:
        r = post(srv, "sk-z", {"model": "base", "prompt": _batch_of(left), "max_tokens": 1, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == left
        settled(52)
        assert _used(srv, "sk-z") == 2000
    r = post(srv, "sk-z", {"model": "base", "prompt": [5], "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
