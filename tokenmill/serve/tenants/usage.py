"""Usage metering: per tenant, model (or adapter) and UTC day, the requests, prompt / cached / completion tokens,
errors by kind and their cost, in an embedded SQLite database (`--usage-db FILE`).

A finished HTTP request is one `record()`: appended to a queue in memory (no I/O on the event loop), written by a
background thread in one transaction at most FLUSH_S later (WAL mode, so readers never block it). A crash or
`kill -9` loses at most that last interval. Prices come from `--pricing FILE` (USD per million tokens, by
model, with a default):

```yaml
default: {input: 0.10, cached_input: 0.05, output: 0.40}
models:
  sql-adapter: {input: 0.20, output: 0.80}
```
"""
from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

FLUSH_S = 0.25
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
"""
_ADD = """INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, model, day) DO UPDATE SET
    requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    cached_tokens = cached_tokens + excluded.cached_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens, errors = errors + excluded.errors,
    cost = cost + excluded.cost"""
_ADD_ERROR = """INSERT INTO errors VALUES (?, ?, ?, ?, 1) ON CONFLICT (tenant, model, day, kind) DO UPDATE SET
    count = count + 1"""


def read_usage(store: "UsageStore", scope: dict, tenant: str | None, start: str | None, to: str | None,
               group_by: str) -> list[dict]:
    """GET /v1/usage of the server and the router (blocking: SQLite). The admin sees every tenant, a tenant's key
    its own only; APIError otherwise."""
    from tokenmill.serve.errors import APIError, bad_request

    state = scope.get("state", {})
    who = state.get("tenant")
    if who is None and not state.get("admin"):
        raise APIError(403, "/v1/usage needs the admin key or a tenant's key.", None, "permission_denied")
    if who is not None:
        if tenant is not None and tenant != who.name:
            raise APIError(403, "A tenant's key sees only its own usage.", "tenant", "permission_denied")
        tenant = who.name
    groups = tuple(g.strip() for g in group_by.split(",") if g.strip())
    store.flush()
    try:
        return store.query(tenant, start, to, groups)
    except ValueError as e:
        raise bad_request(str(e), "group_by") from None


def mark(scope: dict, model: str, submission) -> None:
    """A route handler's half: which model the request ran and its Submission, for the middleware to meter."""
    state = scope.setdefault("state", {})
    state["model"] = model
    state["submission"] = submission


def utc_day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(t))


class UsageStore:
    def __init__(self, path: str, pricing: Pricing | None = None, flush_s: float = FLUSH_S) -> None:
        self.path = path
        self.pricing = pricing or Pricing()
        self.flush_s = flush_s
        db = sqlite3.connect(path)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            db.commit()
        finally:
            db.close()
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._flushed = threading.Condition()
        self._generation = 0  # flushes done
        self._thread = threading.Thread(target=self._run, name="tokenmill-usage", daemon=True)
        self._thread.start()

    # ---- the event loop's side: no I/O --------------------------------------------------------------------
    def record(self, tenant: str, model: str, prompt: int, cached: int, completion: int,
               error: str | None = None, when: float | None = None) -> None:
        cost = self.pricing.for_model(model).cost(prompt, cached, completion)
        with self._lock:
            self._pending.append((tenant, model, utc_day(time.time() if when is None else when), prompt, cached,
                                  completion, error, cost))

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
            batch, self._pending = self._pending, []
        if batch:
            try:
                with db:
                    for tenant, model, day, prompt, cached, completion, error, cost in batch:
                        db.execute(_ADD, (tenant, model, day, 1, prompt, cached, completion, int(error is not None),
                                          cost))
                        if error is not None:
                            db.execute(_ADD_ERROR, (tenant, model, day, error))
            except sqlite3.Error:
                log.exception("usage: writing %d record(s) failed; they are kept for the next flush", len(batch))
                with self._lock:
                    self._pending = batch + self._pending
        with self._flushed:
            self._generation += 1
            self._flushed.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything recorded so far is written (tests, /v1/usage reads what was recorded)."""
        with self._flushed:
            target = self._generation + 2  # one flush may already be running with an older batch
            self._wake.set()
            return self._flushed.wait_for(lambda: self._generation >= target or not self._thread.is_alive(),
                                          timeout)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- reading ----------------------------------------------------------------------------------------------
    def query(self, tenant: str | None = None, start: str | None = None, end: str | None = None,
              group_by: tuple[str, ...] = ("tenant", "model")) -> list[dict]:
        """Rows grouped by `group_by` (tenant, model, day), days in [start, end] (YYYY-MM-DD, inclusive)."""
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
        db = sqlite3.connect(self.path)
        try:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute(sql, args)]
        finally:
            db.close()


def rows_to_csv(rows: list[dict]) -> str:
    import csv
    import io

    out = io.StringIO()
    if rows:
        w = csv.DictWriter(out, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out.getvalue()
