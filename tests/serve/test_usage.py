"""Usage metering (--usage-db): per tenant, model and day in SQLite, written off the event loop; /v1/usage for
the admin (all tenants) and a tenant (its own), rate-limited per caller; the totals equal the responses' `usage`;
records reach the file unprompted within the flush interval, and a kill -9 loses nothing written; a failing
SQLite keeps a bounded queue. The reader's own thread and the rate limiter: test_usage_reader.py."""
from __future__ import annotations

import json
import signal
import sqlite3
import time

import httpx
import pytest

from server_harness import start_server
from tiny import make_tiny_model
from tokenmill.serve.tenants.usage import READ_BURST, Price, Pricing, UsageStore, load_pricing, rows_to_csv


def test_store_groups_prices_and_csv(tmp_path):
    store = UsageStore(str(tmp_path / "u.db"), Pricing(Price(1.0, 0.5, 2.0), {"m2": Price(10.0, None, 20.0)}))
    day1, day2 = 86400 * 20000.0, 86400 * 20001.0
    store.record("a", "m1", 100, 40, 10, when=day1)
    store.record("a", "m1", 10, 0, 5, when=day2)
    store.record("a", "m2", 1000, 0, 100, error="http_400", when=day2)
    store.record("b", "m1", 7, 0, 3, when=day1)
    assert store.flush()
    rows = store.query(group_by=("tenant",))
    assert rows == [
        {"tenant": "a", "requests": 3, "prompt_tokens": 1110, "cached_tokens": 40, "completion_tokens": 115,
         "errors": 1, "cost": pytest.approx((60 * 1.0 + 40 * 0.5 + 10 * 2.0 + 10 * 1.0 + 5 * 2.0
                                              + 1000 * 10.0 + 100 * 20.0) / 1e6)},
        {"tenant": "b", "requests": 1, "prompt_tokens": 7, "cached_tokens": 0, "completion_tokens": 3, "errors": 0,
         "cost": pytest.approx((7 * 1.0 + 3 * 2.0) / 1e6)}]
    by_day = store.query("a", group_by=("day", "model"))
    assert [(r["day"], r["model"], r["requests"]) for r in by_day] == [
        ("2024-10-04", "m1", 1), ("2024-10-05", "m1", 1), ("2024-10-05", "m2", 1)]
    assert [r["requests"] for r in store.query(start="2024-10-05", end="2024-10-05", group_by=("tenant",))] == [2]
    assert rows_to_csv(store.query(group_by=("tenant",))).splitlines()[0].startswith("tenant,requests,")
    with pytest.raises(ValueError, match="group_by"):
        store.query(group_by=("tenant; DROP TABLE usage",))
    store.close()


def test_pricing_file(tmp_path):
    p = tmp_path / "prices.yaml"
    p.write_text("default: {input: 0.1, output: 0.4}\nmodels:\n  sql: {input: 1, cached_input: 0.5, output: 2}\n")
    pricing = load_pricing(str(p))
    assert pricing.for_model("x") == Price(0.1, None, 0.4) and pricing.for_model("sql").cached_input == 0.5
    p.write_text("default: {input: -1}")
    with pytest.raises(ValueError, match="non-negative"):
        load_pricing(str(p))


@pytest.fixture
def metered(tmp_path):
    base = make_tiny_model(tmp_path / "base", "llama")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]},
                                               {"name": "c", "keys": ["sk-c"]}]}))
    prices = tmp_path / "prices.yaml"
    prices.write_text("default: {input: 1.0, output: 2.0}\n")
    db = tmp_path / "usage.db"
    srv = start_server(base, tmp_path / "server.log", "--served-model-name", "base", "--api-keys-file", str(keys),
                       "--admin-key", "sk-admin", "--usage-db", str(db), "--pricing", str(prices),
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", "256")
    yield srv, db
    srv.stop(signal.SIGKILL)


def _file_requests(db) -> int:
    try:
        con = sqlite3.connect(db)
        try:
            return con.execute("SELECT COALESCE(SUM(requests), 0) FROM usage").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return -1


def call(srv, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.url(path), json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_usage_totals_equal_the_responses_and_survive_kill_9(metered):
    srv, db = metered
    sent = {"a": [0, 0, 0], "b": [0, 0, 0]}  # requests, prompt tokens, completion tokens

    def add(tenant: str, usage: dict) -> None:
        sent[tenant][0] += 1
        sent[tenant][1] += usage["prompt_tokens"]
        sent[tenant][2] += usage["completion_tokens"]

    r = call(srv, "sk-a", {"model": "base", "prompt": "The quick", "max_tokens": 5, "n": 2})
    add("a", r.json()["usage"])
    r = call(srv, "sk-a", {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
             "/v1/chat/completions")
    add("a", r.json()["usage"])
    with httpx.stream("POST", srv.url("/v1/completions"), headers={"Authorization": "Bearer sk-b"}, timeout=60,
                      json={"model": "base", "prompt": "Paged", "max_tokens": 6, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    add("b", events[-1]["usage"])
    # A stream the client leaves after a few tokens is metered on what was generated for it before the abort.
    read = 0
    with httpx.stream("POST", srv.url("/v1/completions"), headers={"Authorization": "Bearer sk-c"}, timeout=60,
                      json={"model": "base", "prompt": "Paged", "max_tokens": 200, "ignore_eos": True,
                            "stream": True, "logprobs": 1}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                read += len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                if read >= 3:
                    break
    bad = call(srv, "sk-b", {"model": "base", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400
    sent["b"][0] += 1  # an error is a metered request with no tokens
    # Unprompted (no /v1/usage read forces a flush), the writer thread commits within its interval.
    deadline = time.monotonic() + 5
    while _file_requests(db) != sent["a"][0] + sent["b"][0] + 1:
        assert time.monotonic() < deadline, "the usage records were not written within 5 s"
        time.sleep(0.05)
    admin = {"Authorization": "Bearer sk-admin"}
    rows = httpx.get(srv.url("/v1/usage"), params={"group_by": "tenant"}, headers=admin, timeout=30).json()["data"]
    got = {r["tenant"]: [r["requests"], r["prompt_tokens"], r["completion_tokens"]] for r in rows}
    aborted = got.pop("c")
    assert got == sent
    assert aborted[:2] == [1, sent["b"][1]] and read <= aborted[2] < 200, (aborted, read)
    sent["c"] = aborted
    assert {r["tenant"]: r["errors"] for r in rows} == {"a": 0, "b": 1, "c": 0}
    a_cost = next(r["cost"] for r in rows if r["tenant"] == "a")
    assert a_cost == pytest.approx((sent["a"][1] * 1.0 + sent["a"][2] * 2.0) / 1e6)
    # A tenant sees its own usage only.
    own = httpx.get(srv.url("/v1/usage"), headers={"Authorization": "Bearer sk-a"}, timeout=30).json()["data"]
    assert {r["tenant"] for r in own} == {"a"}
    assert httpx.get(srv.url("/v1/usage"), params={"tenant": "b"}, headers={"Authorization": "Bearer sk-a"},
                     timeout=30).status_code == 403
    csv = httpx.get(srv.url("/v1/usage"), params={"format": "csv", "group_by": "tenant,model,day"}, headers=admin,
                    timeout=30)
    lines = csv.text.splitlines()
    assert csv.headers["content-type"].startswith("text/csv") and len(lines) == 5, csv.text
    assert lines[2].startswith("b,-,") and lines[2].endswith(",1,0.0")  # a body refused while parsing: no model known yet
    # Reads are rate-limited per caller: tenant b past its burst gets 429 in OpenAI's shape; c still reads.
    codes = []
    for _ in range(READ_BURST + 20):  # a read a second refills: these come far faster
        r = httpx.get(srv.url("/v1/usage"), headers={"Authorization": "Bearer sk-b"}, timeout=30)
        codes.append(r.status_code)
        if r.status_code == 429:
            break
    assert codes[:READ_BURST] == [200] * READ_BURST and codes[-1] == 429, codes
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    assert httpx.get(srv.url("/v1/usage"), headers={"Authorization": "Bearer sk-c"}, timeout=30).status_code == 200
    # kill -9: what /v1/usage showed was written; the file opens and holds it.
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(10)
    con = sqlite3.connect(db)
    after = {t: [r, p, c] for t, r, p, c in con.execute(
        "SELECT tenant, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens) FROM usage GROUP BY tenant")}
    con.close()
    assert after == sent


def _file_rows(path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT tenant, requests, prompt_tokens, completion_tokens FROM usage").fetchall()
    finally:
        con.close()


def test_a_failed_write_keeps_the_records_for_the_next(tmp_path, monkeypatch):
    """SQLite refusing a flush (a full disk, a lock) loses nothing: the batch goes back to the queue, and reads
    count it meanwhile."""
    from tokenmill.serve.tenants import usage

    store = UsageStore(str(tmp_path / "u.db"))
    monkeypatch.setattr(usage, "_ADD", "INSERT INTO no_such_table VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
    store.record("a", "m", 5, 0, 2)
    assert store.flush()
    assert _file_rows(tmp_path / "u.db") == []
    assert [(r["requests"], r["prompt_tokens"]) for r in store.query()] == [(1, 5)]  # from the queue
    monkeypatch.undo()
    store.record("a", "m", 1, 0, 1)
    assert store.flush()
    assert _file_rows(tmp_path / "u.db") == [("a", 2, 6, 3)]
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in store.query()] == [(2, 6, 3)]
    assert store.dropped == 0
    store.close()


def test_a_persistent_sqlite_failure_keeps_a_bounded_queue(tmp_path, monkeypatch, caplog):
    """Fault injection: every write fails. The queue stays at max_pending records, the oldest are dropped,
    counted and logged; once SQLite works again the newest reach the file."""
    from tokenmill.serve.tenants import usage

    store = UsageStore(str(tmp_path / "u.db"), max_pending=4)
    monkeypatch.setattr(usage, "_ADD", "INSERT INTO no_such_table VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
    for i in range(3):
        store.record("a", "m", i, 0, 0)
    assert store.flush()  # fails: the 3 go back to the queue
    for i in range(3, 10):
        store.record("a", "m", i, 0, 0)
        assert len(store._pending) <= 4
    assert store.flush()  # fails again
    assert store.dropped == 6 and len(store._pending) == 4
    assert "6 record(s) dropped so far" in caplog.text
    assert [(r["requests"], r["prompt_tokens"]) for r in store.query()] == [(4, 6 + 7 + 8 + 9)]  # the newest
    monkeypatch.undo()
    assert store.flush()
    assert _file_rows(tmp_path / "u.db") == [("a", 4, 6 + 7 + 8 + 9, 0)]
    assert store.dropped == 6 and not store._pending
    store.close()


def test_a_request_refused_before_its_body_is_metered_under_model_dash(tmp_path):
    """docs/tenants.md, "Usage metering": the per-request limit refuses before the body names the model, so the
    429 is a request and an error of model `-`, next to the admitted request's row under its model; so are the
    requests refused before they are submitted, though their body named a model (404: one not served; 400: a
    field out of range)."""
    base = make_tiny_model(tmp_path / "base", "llama")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "a", "keys": ["sk-a"], "limits": {"requests_per_minute": 1}},
                                            {"name": "b", "keys": ["sk-b"]}]}))
    srv = start_server(base, tmp_path / "server.log", "--served-model-name", "base", "--api-keys-file", str(keys),
                       "--admin-key", "sk-admin", "--usage-db", str(tmp_path / "usage.db"),
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", "256")
    try:
        assert call(srv, "sk-a", {"model": "base", "prompt": "The quick", "max_tokens": 2}).status_code == 200
        assert call(srv, "sk-a", {"model": "base", "prompt": "The quick", "max_tokens": 2}).status_code == 429
        assert call(srv, "sk-b", {"model": "other", "prompt": "The quick", "max_tokens": 2}).status_code == 404
        assert call(srv, "sk-b", {"model": "base", "prompt": "The quick", "max_tokens": -1}).status_code == 400
        rows = httpx.get(srv.url("/v1/usage"), params={"group_by": "tenant,model"}, timeout=30,
                         headers={"Authorization": "Bearer sk-admin"}).json()["data"]
        got = {(r["tenant"], r["model"]): (r["requests"], r["errors"], r["prompt_tokens"]) for r in rows}
        assert got.keys() == {("a", "base"), ("a", "-"), ("b", "-")}, rows
        assert got["a", "-"] == (1, 1, 0) and got["a", "base"][:2] == (1, 0) and got["b", "-"] == (2, 2, 0), rows
    finally:
        srv.stop(signal.SIGKILL)
