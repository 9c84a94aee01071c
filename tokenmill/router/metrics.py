"""The router's Prometheus metrics, under `tokenmill:router_*`, labelled by backend, in an own registry
(several routers can live in one process, as in the tests)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self, backends: list[str]) -> None:
        disable_created_metrics()
        self.registry = r = CollectorRegistry(auto_describe=True)
        b = ["backend"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenmill:router_{name}", doc, b, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:router_{name}", doc, b, registry=r)

        self.requests = counter("requests", "Requests sent to the backend (retries included).")
        self.errors = counter("errors", "Requests to the backend that failed (connect, 5xx, broken stream).")
        self.retries = counter("retries", "Requests retried on another backend after this one failed.")
        self.hit_tokens = counter("prefix_hit_tokens", "Prompt tokens the chosen backend was known to cache.")
        self.query_tokens = counter("prefix_query_tokens", "Prompt tokens looked up for prefix-aware routing.")
        self.in_flight = gauge("in_flight_requests", "Requests in flight at the backend.")
        self.load = gauge("in_flight_tokens", "Outstanding tokens (prompt estimate + max_tokens) at the backend.")
        self.healthy = gauge("backend_healthy", "1 while the backend is in the rotation.")
        # Disaggregated prefill/decode (--pd).
        self.prefill_seconds = Histogram("tokenmill:router_prefill_seconds", "Prefill-instance time per request "
                                         "(its KV is handed to the decode instance).", registry=r,
                                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.prefill_failures = Counter("tokenmill:router_prefill_failures", "Prefills that failed (the decode "
                                        "instance computed the prompt).", registry=r)
        for name in backends:  # export zeros from the start
            for m in (self.requests, self.errors, self.retries, self.hit_tokens, self.query_tokens,
                      self.in_flight, self.load, self.healthy):
                m.labels(backend=name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
