"""Who may call which route. Three kinds of caller besides everyone:

- the admin key (`--admin-key`): every route;
- a tenant key (`--api-keys-file`, or the single `--api-key`): generation, its own models and usage,
  tokenize / detokenize;
- an internal caller (`--internal-api-key`; the admin key too): what the router and disaggregated-prefill peers
  read off a server — KV events, KV blocks, diagnostics, metrics — and, as an untenanted caller, generation
  (the router forwards its tenants' requests with it).

The table below is the one place that says so; docs/tenants.md prints it, and tests/serve/test_tenant_security.py
tries every route with every other role. A route missing from it needs a tenant key (so an unknown URL answers
404 to a caller who may ask, and 401 to one who may not). With no keys at all — no --api-keys-file, no admin or
internal key — a server behaves as before roles existed: one --api-key (or none) opens every route but /admin."""
from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    OPEN = "open"  # anyone, no key
    TENANT = "tenant"  # a tenant key (also the internal and admin keys)
    INTERNAL = "internal"  # the internal key or the admin key
    ADMIN = "admin"  # the admin key only


ROUTES: dict[str, Role] = {
    "/health": Role.OPEN,
    "/version": Role.OPEN,
    "/docs": Role.OPEN,
    "/docs/oauth2-redirect": Role.OPEN,
    "/redoc": Role.OPEN,
    "/openapi.json": Role.OPEN,
    "/": Role.OPEN,  # the web console's page (holds no data; it calls the /v1 routes with the key), JSON else
    "/admin/tenants": Role.ADMIN,
    "/v1/completions": Role.TENANT,
    "/v1/chat/completions": Role.TENANT,
    "/v1/responses": Role.TENANT,
    "/v1/responses/{response_id}": Role.TENANT,
    "/v1/messages": Role.TENANT,
    "/v1/messages/count_tokens": Role.TENANT,
    "/v1/embeddings": Role.TENANT,
    "/v1/models": Role.TENANT,
    "/v1/models/{model}": Role.TENANT,
    "/v1/usage": Role.TENANT,
    "/tokenize": Role.TENANT,
    "/detokenize": Role.TENANT,
    "/metrics": Role.INTERNAL,  # tenants' names and usage are in it; open without tenants (see route_role)
    "/v1/kv_events": Role.INTERNAL,
    "/v1/kv_blocks": Role.INTERNAL,
    "/v1/diagnostics": Role.INTERNAL,
    "/v1/load_lora_adapter": Role.ADMIN,
    "/v1/unload_lora_adapter": Role.ADMIN,
    "/admin/reload": Role.ADMIN,
}


def route_role(path: str) -> Role:
    if path in ROUTES:
        return ROUTES[path]
    if path == "/ui" or path.startswith("/ui/"):
        return Role.OPEN  # the console's static files (serve/routes/ui.py): no data in them
    if path.startswith("/v1/models/"):
        return Role.TENANT
    if path.startswith("/admin/"):
        return Role.ADMIN
    return Role.TENANT


def caller_may(caller: Role, route: Role) -> bool:
    """Whether a caller authenticated as `caller` (TENANT, INTERNAL or ADMIN) may call a route needing `route`."""
    order = {Role.OPEN: 0, Role.TENANT: 1, Role.INTERNAL: 2, Role.ADMIN: 3}
    return order[caller] >= order[route]
