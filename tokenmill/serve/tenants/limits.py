"""Per-tenant admission limits, counted in sequences (prompts x n: the work a request really asks for) and in
tokens charged exactly. Before a request's body is read the middleware takes one sequence: a slot of `concurrent`
and a token of the requests-per-minute bucket (capacity = the per-minute limit, refilled continuously), a cheap
refusal for a tenant already at its limit. Once the handler has parsed the body it takes the rest of the request's
sequences (`admit_sequences`); the middleware releases all of them when the response ends. Token budgets: the
handler reserves the request's worst case (every prompt's tokens + n x max_tokens, the room left in max_model_len
when unset) from the tokens-per-minute bucket and the day's tokens (UTC); when the request ends the middleware
settles it at what it really used: unused tokens go back, usage beyond the reservation is charged too (a bucket
may go into debt, and refuses every request until the debt is repaid). A refused request gets 429 in OpenAI's
shape, `rate_limit_exceeded` (`insufficient_quota` for the day's budget), with `Retry-After`: the whole seconds
until a slot or enough tokens free up. Counts live in this process (the event loop's thread); data-parallel
replicas share the API process and so the counts; a router in front keeps its own counts for all its backends."""
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

    def admit(self, tenant: Tenant, sequences: int = 1, held: int = 0) -> APIError | None:
        """Take `sequences` slots and as many per-minute request tokens for `tenant`, or say why not (nothing taken
        then). `held`: what the same request holds already, so one that alone asks for more than a limit allows
        is told that no retry will help."""
        lim = tenant.limits
        asked = held + sequences
        busy = self.in_flight.get(tenant.name, 0)
        if lim.concurrent is not None:
            if asked > lim.concurrent:
                return _too_large(f"Request too large for {tenant.name}: {asked} sequences (prompts x n), above its "
                                  f"limit of {lim.concurrent} in flight. Send fewer prompts or a lower n.")
            if busy + sequences > lim.concurrent:
                return _limited(f"Rate limit reached for {tenant.name}: {busy} sequences (prompts x n) in flight "
                                f"(limit {lim.concurrent}). Please retry after a request finishes.", 1)
        bucket = None
        if lim.requests_per_minute is not None:
            if asked > lim.requests_per_minute:
                return _too_large(f"Request too large for {tenant.name}: {asked} sequences (prompts x n), above its "
                                  f"{lim.requests_per_minute} requests per minute. Send fewer prompts or a lower n.")
            rate = lim.requests_per_minute / 60.0  # tokens per second
            now = self.clock()
            bucket = self.buckets.setdefault(tenant.name, _Bucket(float(lim.requests_per_minute), now))
            _refill(bucket, float(lim.requests_per_minute), rate, now)
            if bucket.tokens < sequences:
                wait = math.ceil((sequences - bucket.tokens) / rate)
                return _limited(f"Rate limit reached for {tenant.name}: {lim.requests_per_minute} requests "
                                f"(sequences: prompts x n) per minute. Please retry in {wait} s.", wait)
            bucket.tokens -= sequences
        self.in_flight[tenant.name] = busy + sequences
        return None

    def reserve(self, tenant: Tenant, tokens: int, used: Callable[[], int]) -> Reservation | APIError:
        """Take a request's worst-case `tokens` from the tenant's token budgets, or say why not (nothing taken)."""
        lim = tenant.limits
        tpm_bucket = None
        if lim.tokens_per_minute is not None:
            if tokens > lim.tokens_per_minute:
                return _too_large(f"Request too large for {tenant.name}: up to {tokens} tokens (prompts + n x "
                                  f"max_tokens), above its {lim.tokens_per_minute} tokens per minute. Lower "
                                  "max_tokens, n or the prompts.")
            rate = lim.tokens_per_minute / 60.0
            now = self.clock()
            tpm_bucket = self.token_buckets.setdefault(tenant.name, _Bucket(float(lim.tokens_per_minute), now))
            _refill(tpm_bucket, float(lim.tokens_per_minute), rate, now)
            if tpm_bucket.tokens < tokens:  # also while in debt: the wait repays it
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
        """The request ended having used `r.used()` tokens: what it did not use goes back, what it used beyond its
        reservation is charged too (the buckets may go into debt: `reserve` refuses until it is repaid)."""
        lim = r.tenant.limits
        extra = r.used() - r.tokens  # > 0: more than reserved (an estimate that fell short), < 0: unused
        if extra == 0:
            return
        if lim.tokens_per_minute is not None and r.tenant.name in self.token_buckets:
            b = self.token_buckets[r.tenant.name]
            b.tokens = min(float(lim.tokens_per_minute), b.tokens - extra)
        if lim.tokens_per_day is not None:
            self._day_add(r.tenant.name, r.day, extra)

    def _day_add(self, name: str, day: int, n: int) -> None:
        key = (name, day)
        self.day_used[key] = self.day_used.get(key, 0) + n
        for old in [k for k in self.day_used if k[1] < day - 1]:  # keep today and yesterday only
            del self.day_used[old]

    def release(self, tenant: Tenant, sequences: int = 1) -> None:
        n = self.in_flight.get(tenant.name, 0) - sequences
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


def admit_sequences(scope: dict[str, Any], limiter: TenantLimiter, tenant: Tenant | None, sequences: int) -> None:
    """A route handler's half of admission, once it knows the request's sequences (prompts x n): take those beyond
    the one the middleware took before the body was read (raising the 429), and say so in the scope, where the
    middleware finds how many to release."""
    state = scope.get("state", {})
    held = state.get("sequences")
    if tenant is None or held is None or sequences <= held:  # not admitted by the middleware: nothing to count
        return
    error = limiter.admit(tenant, sequences - held, held)
    if error is not None:
        raise error
    state["sequences"] = sequences


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


def _too_large(message: str) -> APIError:
    # As OpenAI's "Request too large ... tokens per min": a 429, though only a smaller request will pass.
    return _limited(message, 60)


def _limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, None, "rate_limit_exceeded", headers={"Retry-After": str(max(1, retry_after_s))},
                    type="rate_limit_error")
