"""Prefix-cache isolation between tenants. A request's KV blocks are named by a hash chain over its tokens
(core/kv_cache.hash_block); a salt mixed into that chain makes equal prompts under different salts name
different blocks, so a request never hits — and its `cached_tokens`, its time to first token and the prefix-hit
counters never reveal — blocks another salt computed (vLLM's `cache_salt` closes the same side channel).

The salt of a tenant's request is its cache group (its name unless its entry names a `cache_group` it shares
with others) together with the request's own `cache_salt`, encoded so that no choice of `cache_salt` can spell
another group's salt. Callers without a tenant (no keys file, the admin, the router forwarding a tenant's
request with that tenant's salt already in `cache_salt`) use the request's `cache_salt` as given."""
from __future__ import annotations

import json

from tokenmill.serve.tenants.keys import Tenant


def cache_salt_for(tenant: Tenant | None, requested: str | None) -> str | None:
    if tenant is None:
        return requested
    return json.dumps([tenant.salt_group, requested])
