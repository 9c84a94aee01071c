"""The router's settings (tokenmill router's flags)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterConfig:
    backends: list[str]
    policy: str = "round-robin"
    tokenizer: str | None = None
    block_size: int | None = None  # None: as the backends report in /v1/kv_events (default 16)
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    poll_interval_s: float = 0.1
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 600.0  # between bytes: long prefills of long prompts
    # Disaggregated prefill/decode (--pd): each request first runs on a prefill instance (kv_producer) with
    # max_tokens=1, which hands its prompt's KV over; then `backends` (kv_consumer instances) decode it.
    prefill: list[str] = field(default_factory=list)
    # Tenants at the router (router/tenants.py): keys, limits and metering over all backends.
    api_keys_file: str | None = None
    admin_key: str | None = None
    usage_db: str | None = None
    pricing: str | None = None
    backend_api_key: str | None = None  # sent to the backends in place of a tenant's key
    internal_api_key: str | None = None  # the router's own internal routes (/metrics) for scrapers (serve/roles.py)
    max_request_body_bytes: int = 64 << 20
