"""GET /admin/tenants (the admin key): each tenant's limits from --api-keys-file and what it holds now — sequences
in flight, the requests and tokens left in its per-minute buckets, today's tokens — and which limits it is at, i.e.
who is being throttled right now. The web console's Usage page shows it; the counts are the limiter's own
(serve/tenants/limits.py), read on the event loop that updates them."""
from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import FastAPI

from tokenmill.serve.errors import APIError
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import Tenant
from tokenmill.serve.tenants.limits import TenantLimiter, _refill


def tenant_status(limiter: TenantLimiter, tenant: Tenant) -> dict:
    lim = tenant.limits
    name = tenant.name
    in_flight = limiter.in_flight.get(name, 0)
    out: dict = {"tenant": name, "limits": asdict(lim), "in_flight": in_flight, "at_limit": []}
    now = limiter.clock()
    for key, buckets, limit in (("requests_left_this_minute", limiter.buckets, lim.requests_per_minute),
                                ("tokens_left_this_minute", limiter.token_buckets, lim.tokens_per_minute)):
        if limit is None:
            out[key] = None
            continue
        bucket = buckets.get(name)
        if bucket is not None:  # refilled to now, as the next admission would see it (read-only: a copy)
            bucket = type(bucket)(bucket.tokens, bucket.last)
            _refill(bucket, float(limit), limit / 60.0, now)
        out[key] = limit if bucket is None else int(bucket.tokens)
    day = int(limiter.wall() // 86400)
    out["tokens_today"] = limiter.day_used.get((name, day), 0) if lim.tokens_per_day is not None else None
    if lim.concurrent is not None and in_flight >= lim.concurrent:
        out["at_limit"].append("concurrent")
    if out["requests_left_this_minute"] is not None and out["requests_left_this_minute"] < 1:
        out["at_limit"].append("requests_per_minute")
    if out["tokens_left_this_minute"] is not None and out["tokens_left_this_minute"] <= 0:
        out["at_limit"].append("tokens_per_minute")
    if lim.tokens_per_day is not None and out["tokens_today"] >= lim.tokens_per_day:
        out["at_limit"].append("tokens_per_day")
    return out


def add_tenant_status_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/admin/tenants")
    async def tenants():
        """Every tenant's limits and what it holds now (the admin key only: the middleware checks it)."""
        if state.keys is None:
            raise APIError(404, "This server has no --api-keys-file: no tenants.", None, "not_found")
        table = state.keys.table
        return {"object": "list", "time": time.time(),
                "data": [tenant_status(state.limiter, t) for t in table.tenants.values()]}
