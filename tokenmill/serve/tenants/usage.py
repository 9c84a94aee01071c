"""Usage metering: per tenant, model (or adapter) and UTC day, the requests, prompt / cached / completion tokens,
errors by kind and their cost, in an embedded SQLite database (`--usage-db FILE`).

A finished HTTP request is one `record()`: appended to a queue in memory (no I/O on the event loop), written by a
background thread in one transaction at most FLUSH_S later (WAL mode, so readers never block it). A crash or
`kill -9` loses at most that last interval. While SQLite keeps failing (a full disk, a broken file) the queue
keeps at most `max_pending` records: past that the oldest are dropped, counted (`dropped`) and logged.

`GET /v1/usage` reads on a thread of its own with its own connection (never the tokenizer's thread, never
waiting for the writer): the committed rows of one read transaction plus the records still queued that it does
not hold (each record has a sequence number; the writer commits the last one it wrote with its rows), so a read
sees every request recorded before it. Reads are rate-limited per caller (READS_PER_S, burst READ_BURST; 429
with Retry-After) and at most MAX_QUEUED_READS wait for the reader thread at a time.

Prices come from `--pricing FILE` (USD per million tokens, by model, with a default):

```yaml
default: {input: 0.10, cached_input: 0.05, output: 0.40}
models:
  sql-adapter: {input: 0.20, output: 0.80}
```
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import sqlite3
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

FLUSH_S = 0.25
MAX_PENDING = 65_536  # records queued for the writer at most (about 15 MB); past it the oldest are dropped
READS_PER_S = 1.0  # /v1/usage reads per second per caller (the admin key, each tenant), refilled continuously:
READ_BURST = 5  # ... and at most this many at once. A dashboard polls far less; a read of the whole table costs
# ~25 ms of CPU at 73k rows (benchmarks/usage_load.py), which one key must not repeat at will.
MAX_QUEUED_READS = 8  # reads waiting for the reader thread, over all callers (a bound on its queue)
READER_NICE = 10  # the reader thread's CPU priority (as the tokenizer's slow lane)
GROUPS = ("tenant", "model", "day")
COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "cost")


@dataclass(frozen=True)
class Price:
    input: float = 0.0  # USD per million uncached prompt tokens
    cached_input: float | None = None  # per million cached prompt tokens (None: as input)
    output: float = 0.0  # per million completion tokens

    def cost(self, prompt: int, cached: int, completion: int) -> float:
        cached_rate = self.input if self.cached_input is None else self.cached_input
        return ((prompt - cached) * self.input + cached * cached_rate + completion * self.output) / 1e6


@dataclass
class Pricing:
    default: Price = field(default_factory=Price)
    models: dict[str, Price] = field(default_factory=dict)

    def for_model(self, model: str) -> Price:
        return self.models.get(model, self.default)


def load_pricing(path: str) -> Pricing:
    from tokenmill.serve.tenants.keys import parse_json_or_yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = parse_json_or_yaml(f.read(), path)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror}).") from None

    def price(d, where: str) -> Price:
        if not isinstance(d, dict) or set(d) - {"input", "cached_input", "output"}:
            raise ValueError(f"{path}: {where} must map input / cached_input / output to USD per million tokens.")
        for k, v in d.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{path}: {where}.{k} must be a non-negative number, got {v!r}.")
        return Price(**{k: float(v) for k, v in d.items()})

    if not isinstance(doc, dict) or set(doc) - {"default", "models"}:
        raise ValueError(f"{path}: needs `default` and / or `models`.")
    models = doc.get("models") or {}
    if not isinstance(models, dict):
        raise ValueError(f"{path}: models must be a mapping of model name to prices.")
    return Pricing(price(doc.get("default") or {}, "default"),
                   {name: price(p, f"models.{name}") for name, p in models.items()})


_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL, model TEXT NOT NULL, day TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0, cost REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, model, day));
CREATE TABLE IF NOT EXISTS errors (
    tenant TEXT NOT NULL, model TEXT NOT NULL, day TEXT NOT NULL, kind TEXT NOT NULL,
    count INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (tenant, model, day, kind));
CREATE TABLE IF NOT EXISTS written (id INTEGER PRIMARY KEY CHECK (id = 0), seq INTEGER NOT NULL);
"""
# The sequence number of the last record committed, in the same transaction as its rows: a reader's snapshot
# says which queued records it already holds.
_WRITTEN = "INSERT INTO written VALUES (0, ?) ON CONFLICT (id) DO UPDATE SET seq = excluded.seq"
_ADD = """INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, model, day) DO UPDATE SET
    requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_tokens = cached_tokens + excluded.cached_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens, errors = errors + excluded.errors,
    cost = cost + excluded.cost"""
_ADD_ERROR = """INSERT INTO errors VALUES (?, ?, ?, ?, 1) ON CONFLICT (tenant, model, day, kind) DO UPDATE SET
    count = count + 1"""


@dataclass
class _Bucket:
    tokens: float
    last: float


@dataclass
class ReadLimiter:
    """Per caller token buckets for /v1/usage, and the bound on reads waiting for the reader thread. Called from
    the event loop (server) and from worker threads (router), hence the lock."""

    rate: float = READS_PER_S
    burst: int = READ_BURST
    max_queued: int = MAX_QUEUED_READS
    clock: Callable[[], float] = time.monotonic
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    queued: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, caller: str) -> None:
        """One read for `caller`, or APIError 429 (nothing taken then). release() when the read is done."""
        from tokenmill.serve.errors import APIError

        with self._lock:
            now = self.clock()
            b = self.buckets.setdefault(caller, _Bucket(float(self.burst), now))
            b.tokens = min(float(self.burst), b.tokens + (now - b.last) * self.rate)
            b.last = now
            if b.tokens < 1.0:
                wait = max(1, math.ceil((1.0 - b.tokens) / self.rate))
                raise APIError(429, f"Rate limit reached for /v1/usage: {self.rate:g} reads per second. Please "
                                    f"retry in {wait} s.", None, "rate_limit_exceeded",
                               headers={"Retry-After": str(wait)})
            if self.queued >= self.max_queued:
                raise APIError(429, "Too many /v1/usage reads in progress. Please retry in 1 s.", None,
                               "rate_limit_exceeded", headers={"Retry-After": "1"})
            b.tokens -= 1.0
            self.queued += 1
            if len(self.buckets) > 4096:  # callers idle long enough to be full again need no entry
                for k in [k for k, v in self.buckets.items() if v.tokens + (now - v.last) * self.rate >= self.burst]:
                    del self.buckets[k]

    def release(self) -> None:
        with self._lock:
            self.queued -= 1


def _allowed(store: "UsageStore", scope: dict, tenant: str | None, group_by: str
             ) -> tuple[str, str | None, tuple[str, ...]]:
    """Who may read what: (the caller's rate-limit key, the tenant filter, the groups); APIError otherwise. The
    admin sees every tenant, a tenant's key its own only."""
    from tokenmill.serve.errors import APIError

    state = scope.get("state", {})
    who = state.get("tenant")
    if who is None and not state.get("admin"):
        raise APIError(403, "/v1/usage needs the admin key or a tenant's key.", None, "permission_denied")
    if who is not None:
        if tenant is not None and tenant != who.name:
            raise APIError(403, "A tenant's key sees only its own usage.", "tenant", "permission_denied")
        tenant = who.name
    caller = "admin:" if who is None else "tenant:" + who.name
    return caller, tenant, tuple(g.strip() for g in group_by.split(",") if g.strip())


def read_usage(store: "UsageStore", scope: dict, tenant: str | None, start: str | None, to: str | None,
               group_by: str) -> list[dict]:
    """GET /v1/usage from a worker thread (the router's; blocks it while the store's reader thread reads):
    access, the caller's rate limit, then the rows. APIError otherwise."""
    from tokenmill.serve.errors import bad_request

    caller, tenant, groups = _allowed(store, scope, tenant, group_by)
    store.read_limiter.take(caller)
    try:
        return store.query(tenant, start, to, groups)
    except ValueError as e:
        raise bad_request(str(e), "group_by") from None
    finally:
        store.read_limiter.release()


async def aread_usage(store: "UsageStore", scope: dict, tenant: str | None, start: str | None, to: str | None,
                      group_by: str) -> list[dict]:
    """GET /v1/usage on the event loop: access and the rate limit here, the read on the store's reader thread."""
    from tokenmill.serve.errors import bad_request

    caller, tenant, groups = _allowed(store, scope, tenant, group_by)
    store.read_limiter.take(caller)
    try:
        return await store.aquery(tenant, start, to, groups)
    except ValueError as e:
        raise bad_request(str(e), "group_by") from None
    finally:
        store.read_limiter.release()


def _lower_priority() -> None:
    """The reader thread's nice value (Linux gives each thread its own): the engine and the tokenizer first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READER_NICE)
    except (AttributeError, OSError):
        pass


def mark(scope: dict, model: str, submission) -> None:
    """A route handler's half: which model the request ran and its Submission, for the middleware to meter."""
    state = scope.setdefault("state", {})
    state["model"] = model
    state["submission"] = submission


def utc_day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


class UsageStore:
    def __init__(self, path: str, pricing: Pricing | None = None, flush_s: float = FLUSH_S,
                 max_pending: int = MAX_PENDING) -> None:
        self.path = path
        self.pricing = pricing or Pricing()
        self.flush_s = flush_s
        self.max_pending = max_pending
        db = sqlite3.connect(path)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            db.commit()
            row = db.execute("SELECT seq FROM written").fetchone()
        finally:
            db.close()
        self._seq = row[0] if row else 0  # the last record's sequence number
        # Oldest first, each (seq, tenant, model, day, prompt, cached, completion, error, cost).
        self._pending: deque[tuple] = deque(maxlen=max_pending)
        self._writing: list[tuple] = []  # the batch being committed: readers still count it until it is
        self.dropped = 0  # records lost to a full queue (SQLite failing for long)
        self._dropped_logged = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._flushed = threading.Condition()
        self._generation = 0  # flushes done
        self.read_limiter = ReadLimiter()
        # /v1/usage's reads: one thread with its own connection, so a read never waits for a tokenization
        # (or the reverse) and SQLite's work stays on one thread whatever the number of callers; at a lower CPU
        # priority, as a report can wait where a stream's next token cannot.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-usage-read",
                                          initializer=_lower_priority)
        self._read_db: sqlite3.Connection | None = None  # opened and used on the reader thread only
        self._thread = threading.Thread(target=self._run, name="tokenmill-usage", daemon=True)
        self._thread.start()

    # ---- the event loop's side: no I/O --------------------------------------------------------------------
    def record(self, tenant: str, model: str, prompt: int, cached: int, completion: int,
               error: str | None = None, when: float | None = None) -> None:
        cost = self.pricing.for_model(model).cost(prompt, cached, completion)
        day = utc_day(time.time() if when is None else when)
        with self._lock:
            if len(self._pending) == self.max_pending:
                self.dropped += 1  # the deque drops the oldest (logged by the writer thread)
            self._seq += 1
            self._pending.append((self._seq, tenant, model, day, prompt, cached, completion, error, cost))

    # ---- the writer thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        db = sqlite3.connect(self.path, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a commit survives a process crash
        try:
            while True:
                self._wake.wait(self.flush_s)
                self._wake.clear()
                stop = self._stop
                self._write(db)
                if stop:
                    return
        finally:
            db.close()

    def _write(self, db: sqlite3.Connection) -> None:
        with self._lock:
            batch = self._writing = list(self._pending)
            self._pending.clear()
        if batch:
            try:
                with db:
                    for _, tenant, model, day, prompt, cached, completion, error, cost in batch:
                        db.execute(_ADD, (tenant, model, day, 1, prompt, cached, completion, int(error is not None),
                                          cost))
                        if error is not None:
                            db.execute(_ADD_ERROR, (tenant, model, day, error))
                    db.execute(_WRITTEN, (batch[-1][0],))
            except sqlite3.Error:
                log.exception("usage: writing %d record(s) failed; they are kept for the next flush", len(batch))
                with self._lock:  # one step, so a reader's copy never holds the batch twice
                    # Back in front of the newer ones; a deque filled past its maxlen keeps the newest.
                    kept = deque(batch, maxlen=self.max_pending)
                    kept.extend(self._pending)
                    self.dropped += len(batch) + len(self._pending) - len(kept)
                    self._pending, self._writing = kept, []
            else:
                with self._lock:
                    self._writing = []
        if self.dropped > self._dropped_logged:
            log.error("usage: %d record(s) dropped so far (%d new): the queue holds at most %d while SQLite fails",
                      self.dropped, self.dropped - self._dropped_logged, self.max_pending)
            self._dropped_logged = self.dropped
        with self._flushed:
            self._generation += 1
            self._flushed.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything recorded so far is written (tests, close). Reads do not need it."""
        deadline = time.monotonic() + timeout
        with self._flushed:
            target = self._generation + 2  # one flush may already be running with an older batch
            while self._generation < target and self._thread.is_alive():
                self._wake.set()  # again after each flush: the writer clears it and would sleep flush_s
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._flushed.wait(left)
            return True

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        try:
            self._reader.submit(self._close_reader)
        except RuntimeError:
            return  # closed already
        self._reader.shutdown(wait=True)

    # ---- reading (the reader thread) ------------------------------------------------------------------------
    def query(self, tenant: str | None = None, start: str | None = None, end: str | None = None,
              group_by: tuple[str, ...] = ("tenant", "model")) -> list[dict]:
        """Rows grouped by `group_by` (tenant, model, day), days in [start, end] (YYYY-MM-DD, inclusive): every
        record so far, written or still queued. Blocks the calling thread while the reader thread reads."""
        return self._reader.submit(self._query, tenant, start, end, group_by).result()

    async def aquery(self, tenant: str | None = None, start: str | None = None, end: str | None = None,
                     group_by: tuple[str, ...] = ("tenant", "model")) -> list[dict]:
        return await asyncio.wrap_future(self._reader.submit(self._query, tenant, start, end, group_by))

    def _query(self, tenant: str | None, start: str | None, end: str | None, group_by: tuple[str, ...]
               ) -> list[dict]:
        bad = [g for g in group_by if g not in GROUPS]
        if bad or not group_by:
            raise ValueError(f"group_by must be some of {', '.join(GROUPS)}, got {list(group_by)}.")
        where, args = [], []
        for column, op, value in (("tenant", "=", tenant), ("day", ">=", start), ("day", "<=", end)):
            if value is not None:
                where.append(f"{column} {op} ?")
                args.append(value)
        cols = ", ".join(group_by)
        sums = ", ".join(f"SUM({c}) AS {c}" for c in COLUMNS)
        sql = (f"SELECT {cols}, {sums} FROM usage {'WHERE ' + ' AND '.join(where) if where else ''} "
               f"GROUP BY {cols} ORDER BY {cols}")
        # The queued records first: whatever the writer commits after this copy is newer than the copy, and
        # the snapshot below tells which of the copied ones it already holds.
        with self._lock:
            queued = self._writing + list(self._pending)
        db = self._reader_db()
        db.execute("BEGIN")  # one snapshot for the sequence number and the rows
        try:
            row = db.execute("SELECT seq FROM written").fetchone()
            rows = [dict(r) for r in db.execute(sql, args)]
        finally:
            db.execute("COMMIT")
        written = row[0] if row else 0
        queued = [r for r in queued if r[0] > written and (tenant is None or r[1] == tenant)
                  and (start is None or r[3] >= start) and (end is None or r[3] <= end)]
        return _merge(rows, queued, group_by) if queued else rows

    def _reader_db(self) -> sqlite3.Connection:
        if self._read_db is None:
            # Autocommit (BEGIN / COMMIT above); query_only: this connection never takes the write lock.
            self._read_db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._read_db.execute("PRAGMA query_only=1")
            self._read_db.row_factory = sqlite3.Row
        return self._read_db

    def _close_reader(self) -> None:
        if self._read_db is not None:
            self._read_db.close()
            self._read_db = None


def _merge(rows: list[dict], records: list[tuple], group_by: tuple[str, ...]) -> list[dict]:
    """Add queued records (seq, tenant, model, day, prompt, cached, completion, error, cost) to grouped rows."""
    at = {"tenant": 1, "model": 2, "day": 3}
    out = {tuple(r[g] for g in group_by): r for r in rows}
    for rec in records:
        key = tuple(rec[at[g]] for g in group_by)
        row = out.get(key)
        if row is None:
            row = out[key] = {**dict(zip(group_by, key)), **dict.fromkeys(COLUMNS, 0)}
            row["cost"] = 0.0
        row["requests"] += 1
        row["prompt_tokens"] += rec[4]
        row["cached_tokens"] += rec[5]
        row["completion_tokens"] += rec[6]
        row["errors"] += int(rec[7] is not None)
        row["cost"] += rec[8]
    return [out[k] for k in sorted(out)]


def rows_to_csv(rows: list[dict]) -> str:
    import csv
    import io

    out = io.StringIO()
    if rows:
        w = csv.DictWriter(out, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out.getvalue()
