"""Per-tenant Prometheus counters (requests by outcome, prompt / cached / generated tokens), for the server and the
router alike. A tenant gets a label value of its own up to MAX_TENANT_LABELS names; later ones count under
"other", so a keys file reloaded with new tenants again and again cannot grow the series without end."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

MAX_TENANT_LABELS = 64


class TenantCounters:
    def __init__(self, registry: CollectorRegistry, prefix: str, labels: dict[str, str]) -> None:
        self._labels = labels
        names = list(labels) + ["tenant"]
        self.requests = Counter(f"{prefix}tenant_requests", "Generating requests per tenant by outcome (ok, or the "
                                "HTTP error: http_429, ...); after 64 tenant names: tenant=\"other\".",
                                names + ["outcome"], registry=registry)
        self.tokens = {kind: Counter(f"{prefix}tenant_{kind}_tokens", doc, names, registry=registry)
                       for kind, doc in (
                           ("prompt", "Prompt tokens per tenant."),
                           ("cached", "Prompt tokens per tenant served from the prefix cache."),
                           ("generation", "Generated tokens per tenant (a stream cut short: what was produced "
                                          "for it)."))}
        self._tenants: set[str] = set()

    def record(self, tenant: str, prompt: int, cached: int, generated: int, error: str | None) -> None:
        """One finished generating request of a tenant (the auth middleware's meter)."""
        if tenant not in self._tenants and len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tenant)
        label = dict(self._labels, tenant=tenant if tenant in self._tenants else "other")
        self.requests.labels(outcome=error or "ok", **label).inc()
        for kind, n in (("prompt", prompt), ("cached", cached), ("generation", generated)):
            if n:
                self.tokens[kind].labels(**label).inc(n)
