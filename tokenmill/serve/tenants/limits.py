"""Per-tenant admission limits. Before a request's body is read: concurrent requests in flight, and requests per
minute as a bucket (capacity = the per-minute limit, refilled continuously). Once its prompt is tokenized: token
budgets, reserving the request's worst case (prompt tokens + n x max_tokens for every prompt) from the
tokens-per-minute bucket and the day's tokens (UTC), and giving back what it did not use when it ends
(`Reservation`, settled by the middleware once the response is complete or the client left). A refused request
gets 429 in OpenAI's shape, `rate_limit_exceeded` (`insufficient_quota` for the day's budget), with `Retry-After`:
the whole seconds until a slot or enough tokens free up. Counts live in this process (the event loop's thread);
data-parallel replicas share the API process and so the counts, several servers behind a router do not yet."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenmill.serve.errors import APIError
from tokenmill.serve.tenants.keys import Tenant


@dataclass
class _Bucket:
    tokens: float
    last: float


@dataclass
class Reservation:
    """Tokens taken from a tenant's budgets for one HTTP request; `used()` says what it really used at the end."""

    tenant: Tenant
    tokens: int
    day: int
    used: Callable[[], int]


def _refill(bucket: _Bucket, capacity: float, per_second: float, now: float) -> None:
    bucket.tokens = min(capacity, bucket.tokens + (now - bucket.last) * per_second)
    bucket.last = now


@dataclass
class TenantLimiter:
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time  # for the day of the day's budget (UTC)
    in_flight: dict[str, int] = field(default_factory=dict)
    buckets: dict[str, _Bucket] = field(default_factory=dict)
    token_buckets: dict[str, _Bucket] = field(default_factory=dict)
    day_used: dict[tuple[str, int], int] = field(default_factory=dict)  # (tenant, UTC day) -> tokens

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
            _refill(bucket, float(lim.requests_per_minute), rate, now)
            if bucket.tokens < 1.0:
                wait = math.ceil((1.0 - bucket.tokens) / rate)
                return _limited(f"Rate limit reached for {tenant.name}: {lim.requests_per_minute} requests per "
                                f"minute. Please retry in {wait} s.", wait)
            bucket.tokens -= 1.0
        self.in_flight[tenant.name] = busy + 1
        return None

    def reserve(self, tenant: Tenant, tokens: int, used: Callable[[], int]) -> Reservation | APIError:
        """Take a request's worst-case `tokens` from the tenant's token budgets, or say why not (nothing taken)."""
        lim = tenant.limits
        tpm_bucket = None
        if lim.tokens_per_minute is not None:
            if tokens > lim.tokens_per_minute:
                return _limited(f"Request too large for {tenant.name}: up to {tokens} tokens (prompt + n x "
                                f"max_tokens), above its {lim.tokens_per_minute} tokens per minute. Lower "
                                "max_tokens or the prompt.", 60)
            rate = lim.tokens_per_minute / 60.0
            now = self.clock()
            tpm_bucket = self.token_buckets.setdefault(tenant.name, _Bucket(float(lim.tokens_per_minute), now))
            _refill(tpm_bucket, float(lim.tokens_per_minute), rate, now)
            if tpm_bucket.tokens < tokens:
                wait = math.ceil((tokens - tpm_bucket.tokens) / rate)
                return _limited(f"Rate limit reached for {tenant.name}: {lim.tokens_per_minute} tokens per minute "
                                f"(this request may use {tokens}). Please retry in {wait} s.", wait)
        wall = self.wall()
        day = int(wall // 86400)
        if lim.tokens_per_day is not None:
            spent = self.day_used.get((tenant.name, day), 0)
            if spent + tokens > lim.tokens_per_day:
                wait = math.ceil((day + 1) * 86400 - wall)
                return APIError(429, f"{tenant.name} has used {spent} of its {lim.tokens_per_day} tokens today (UTC); "
                                     f"this request may use {tokens}.", None, "insufficient_quota",
                                headers={"Retry-After": str(max(1, wait))}, type="insufficient_quota")
        if tpm_bucket is not None:
            tpm_bucket.tokens -= tokens
        if lim.tokens_per_day is not None:
            self._day_add(tenant.name, day, tokens)
        return Reservation(tenant, tokens, day, used)

    def settle(self, r: Reservation) -> None:
        """The request ended having used `r.used()` of its reserved tokens: the rest goes back."""
        lim = r.tenant.limits
        unused = max(0, r.tokens - r.used())
        if lim.tokens_per_minute is not None and r.tenant.name in self.token_buckets:
            b = self.token_buckets[r.tenant.name]
            b.tokens = min(float(lim.tokens_per_minute), b.tokens + unused)
        if lim.tokens_per_day is not None:
            self._day_add(r.tenant.name, r.day, -unused)

    def _day_add(self, name: str, day: int, n: int) -> None:
        key = (name, day)
        self.day_used[key] = self.day_used.get(key, 0) + n
        for old in [k for k in self.day_used if k[1] < day - 1]:  # keep today and yesterday only
            del self.day_used[old]

    def release(self, tenant: Tenant) -> None:
        n = self.in_flight.get(tenant.name, 0) - 1
        if n > 0:
            self.in_flight[tenant.name] = n
        else:
            self.in_flight.pop(tenant.name, None)


def worst_case_tokens(prompts: list[list[int]], params: list, max_model_len: int) -> int:
    """What a request may use at most: each prompt's tokens plus n x its max_tokens (unset: the room left in
    max_model_len), as `usage.total_tokens` counts them."""
    total = 0
    for ids, p in zip(prompts, params):
        room = max_model_len - len(ids)
        total += len(ids) + p.n * (room if p.max_tokens is None else min(p.max_tokens, room))
    return total


def reserve_for(scope: dict[str, Any], limiter: TenantLimiter, tenant: Tenant | None, tokens: int,
                used: Callable[[], int]) -> None:
    """A route handler's half: reserve the request's worst case (raising the 429), and leave the reservation where
    the middleware settles it when the response is done."""
    if tenant is None or (tenant.limits.tokens_per_minute is None and tenant.limits.tokens_per_day is None):
        return
    r = limiter.reserve(tenant, tokens, used)
    if isinstance(r, APIError):
        raise r
    scope.setdefault("state", {})["reservation"] = r


def _limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, None, "rate_limit_exceeded", headers={"Retry-After": str(max(1, retry_after_s))},
                    type="rate_limit_error")
