"""GET /v1/usage is cheap for everyone else: it reads on the usage store's own thread and connection (never the
tokenizer's thread), never waits for the writer (WAL snapshot + the records still queued), and each caller is
rate-limited (429 in OpenAI's shape with Retry-After). The server and the router share read_usage / aread_usage."""
from __future__ import annotations

import asyncio
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from tokenmill.serve.errors import APIError
from tokenmill.serve.tenants.usage import ReadLimiter, UsageStore, aread_usage, read_usage

ADMIN = {"state": {"admin": True}}


def tenant_scope(name: str) -> dict:
    return {"state": {"tenant": SimpleNamespace(name=name)}}


def test_a_read_never_waits_for_the_writer(tmp_path):
    """Another connection holds SQLite's write lock, so the writer cannot commit: a read still answers at once
    with every record so far (the committed ones from its snapshot, the rest from the queue). Before, a read
    waited for the writer's flush (up to 10 s) and then missed the uncommitted records."""
    path = str(tmp_path / "u.db")
    store = UsageStore(path, flush_s=3600)  # the writer flushes only when asked
    store.record("a", "m", 10, 0, 1)
    assert store.flush()
    locker = sqlite3.connect(path, isolation_level=None, timeout=0)
    locker.execute("BEGIN IMMEDIATE")  # the write lock: the writer's next commit waits, then fails
    try:
        store.record("a", "m", 5, 0, 2)
        store.record("b", "m", 7, 0, 3)
        store._wake.set()  # the writer tries now (and blocks on the lock)
        with ThreadPoolExecutor(1) as pool:
            rows = pool.submit(read_usage, store, ADMIN, None, None, None, "tenant").result(timeout=30)
        assert locker.in_transaction  # answered while the writer was still locked out
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        ("a", 2, 15, 3), ("b", 1, 7, 3)]
    assert store.flush()
    assert store.query(group_by=("tenant",)) == rows  # the same once written: nothing counted twice
    store.close()


def test_queued_records_follow_the_filters(tmp_path):
    store = UsageStore(str(tmp_path / "u.db"), flush_s=3600)
    day1, day2 = 86400 * 20000.0, 86400 * 20001.0
    store.record("a", "m1", 1, 0, 1, when=day1)
    store.record("a", "m2", 2, 1, 2, when=day2, error="http_400")
    assert store.flush()
    store.record("a", "m1", 4, 0, 4, when=day2)  # queued
    store.record("b", "m1", 8, 0, 8, when=day2)  # queued
    got = store.query("a", start="2024-10-05", group_by=("model", "day"))
    assert [(r["model"], r["day"], r["requests"], r["prompt_tokens"], r["errors"]) for r in got] == [
        ("m1", "2024-10-05", 1, 4, 0), ("m2", "2024-10-05", 1, 2, 1)]
    assert [r["tenant"] for r in store.query(group_by=("tenant",))] == ["a", "b"]
    store.close()


def test_reads_run_on_the_stores_reader_thread(tmp_path):
    store = UsageStore(str(tmp_path / "u.db"))
    seen = []
    real = store._query

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    store._query = spy
    asyncio.run(aread_usage(store, ADMIN, None, None, None, "tenant"))
    read_usage(store, ADMIN, None, None, None, "tenant")
    assert len(seen) == 2 and all(name.startswith("tokenmill-usage-read") for name in seen)
    store.close()


def test_reads_are_rate_limited_per_caller():
    clock = SimpleNamespace(now=100.0)
    limiter = ReadLimiter(rate=1.0, burst=3, clock=lambda: clock.now)
    for _ in range(3):
        limiter.take("tenant:a")
        limiter.release()
    with pytest.raises(APIError) as e:
        limiter.take("tenant:a")
    err = e.value
    assert err.status == 429 and err.headers == {"Retry-After": "1"}
    assert err.body()["error"]["type"] == "rate_limit_error" and err.body()["error"]["code"] == "rate_limit_exceeded"
    limiter.take("tenant:b")  # another caller has its own bucket
    limiter.release()
    clock.now += 1.0  # one read refilled
    limiter.take("tenant:a")
    limiter.release()
    with pytest.raises(APIError):
        limiter.take("tenant:a")


def test_reads_waiting_for_the_reader_are_bounded():
    limiter = ReadLimiter(rate=100.0, burst=100, max_queued=2)
    limiter.take("a")
    limiter.take("b")
    with pytest.raises(APIError) as e:
        limiter.take("c")
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    limiter.release()
    limiter.take("c")


def test_the_route_refuses_a_flood_and_other_callers_go_on(tmp_path):
    """read_usage (the router's) and aread_usage (the server's): a tenant past its burst gets 429 and reads
    nothing; the admin and other tenants still read; a refused call (403) takes no read."""
    store = UsageStore(str(tmp_path / "u.db"))
    store.read_limiter = ReadLimiter(rate=0.001, burst=2)
    store.record("a", "m", 3, 0, 1)
    store.record("b", "m", 4, 0, 1)
    with pytest.raises(APIError) as e:
        read_usage(store, tenant_scope("a"), "b", None, None, "tenant")
    assert e.value.status == 403
    for _ in range(2):
        assert [r["tenant"] for r in read_usage(store, tenant_scope("a"), None, None, None, "tenant")] == ["a"]
    with pytest.raises(APIError) as e:
        asyncio.run(aread_usage(store, tenant_scope("a"), None, None, None, "tenant"))
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
    assert [r["tenant"] for r in asyncio.run(aread_usage(store, tenant_scope("b"), None, None, None, "tenant"))] \
        == ["b"]
    assert len(read_usage(store, ADMIN, None, None, None, "tenant")) == 2
    assert store.read_limiter.queued == 0  # every read, refused or not, gave its place back
    store.close()
