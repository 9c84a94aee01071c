"""Per-tenant admission limits checked before a request's body is read: concurrent requests in flight, and
requests per minute as a token bucket (capacity = the per-minute limit, refilled continuously). A refused request
gets 429 in OpenAI's shape (`rate_limit_exceeded`) with `Retry-After`: the whole seconds until a slot or a token
frees up. Counts live in this process (the event loop's thread); token budgets (tokens per minute, per day)
belong with the usage metering and are not enforced here yet (docs/tenants.md)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from tokenmill.serve.errors import APIError
from tokenmill.serve.tenants.keys import Tenant


@dataclass
class _Bucket:
    tokens: float
    last: float


@dataclass
class TenantLimiter:
    clock: Callable[[], float] = time.monotonic
    in_flight: dict[str, int] = field(default_factory=dict)
    buckets: dict[str, _Bucket] = field(default_factory=dict)

    def admit(self, tenant: Tenant) -> APIError | None:
        """Take a slot and a request token for `tenant`, or say why not (nothing taken then)."""
        lim = tenant.limits
        busy = self.in_flight.get(tenant.name, 0)
        if lim.concurrent is not None and busy >= lim.concurrent:
            return _limited(f"Rate limit reached for {tenant.name}: {busy} requests in flight (limit "
                            f"{lim.concurrent}). Please retry after a request finishes.", 1)
        bucket = None
        if lim.requests_per_minute is not None:
            rate = lim.requests_per_minute / 60.0  # tokens per second
            now = self.clock()
            bucket = self.buckets.setdefault(tenant.name, _Bucket(float(lim.requests_per_minute), now))
            bucket.tokens = min(float(lim.requests_per_minute), bucket.tokens + (now - bucket.last) * rate)
            bucket.last = now
            if bucket.tokens < 1.0:
                wait = math.ceil((1.0 - bucket.tokens) / rate)
                return _limited(f"Rate limit reached for {tenant.name}: {lim.requests_per_minute} requests per "
                                f"minute. Please retry in {wait} s.", wait)
            bucket.tokens -= 1.0
        self.in_flight[tenant.name] = busy + 1
        return None

    def release(self, tenant: Tenant) -> None:
        n = self.in_flight.get(tenant.name, 0) - 1
        if n > 0:
            self.in_flight[tenant.name] = n
        else:
            self.in_flight.pop(tenant.name, None)


def _limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, None, "rate_limit_exceeded", headers={"Retry-After": str(max(1, retry_after_s))},
                    type="rate_limit_error")
