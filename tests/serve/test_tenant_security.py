"""The tenant boundary as an attacker holding one ordinary tenant key tries it (issue 44), against one live server
with tenants, an admin key and an internal key:

- every route x every role (serve/roles.py is the table): a role below the route's is refused (401/403, in
  OpenAI's error shape, naming no tenant and no path), a role at or above it is not;
- adapters: a tenant cannot load or unload any; the admin's loads are confined to --lora-root and every bad path
  gets the same answer (no path, no bytes, no "exists or not"); --max-loaded-loras; an adapter a tenant owns is
  invisible to the others; a name in use cannot be registered again until its requests end;
- the prefix cache: tenant B cannot tell from `cached_tokens` or the prefix-hit counters whether tenant A sent a
  prompt (B computes every block), while A's own repeats and two tenants of one cache group do share hits, and
  `cache_salt` separates requests of one tenant;
- a key removed by a reload under load: the stream in flight ends normally, the key's next request is 401.

Quota attacks (batches, n, echo, cut streams, concurrency at the boundary) are in tests/router/test_router_accounting.py
and tests/serve/test_tenants.py."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from lora_tiny import make_adapter
from server_harness import start_server
from tiny import make_tiny_model

ADMIN, INTERNAL = "sk-admin", "sk-internal"
KEYS = """
tenants:
  - {name: team-a, keys: [sk-a], adapters: ["a-*"]}
  - {name: team-b, keys: [sk-b]}
  - {name: team-c, keys: [sk-c], cache_group: shared}
  - {name: team-d, keys: [sk-d], cache_group: shared}
"""
EXTRA = "  - {name: team-e, keys: [sk-e]}\n"
GENERIC = "lora_path does not name an adapter this server can load."


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenant-security")
    base = make_tiny_model(root / "base", "llama")
    lora_root = root / "loras"
    lora_root.mkdir()
    make_adapter(base, lora_root / "a-private", r=4, alpha=8, seed=1)
    make_adapter(base, lora_root / "spare", r=4, alpha=8, seed=2)
    outside = make_adapter(base, root / "outside", r=4, alpha=8, seed=3)  # a real adapter, outside the root
    (lora_root / "escape").symlink_to(outside)  # a symlink out of the root
    (lora_root / "junk.gguf").write_bytes(b"SECRET-BYTES-" * 64)  # a file that is no adapter
    keys = root / "keys.yaml"
    keys.write_text(KEYS + EXTRA)
    srv = start_server(base, root / "server.log", "--served-model-name", "base", "--api-keys-file", str(keys),
                       "--admin-key", ADMIN, "--internal-api-key", INTERNAL, "--usage-db", str(root / "usage.db"),
                       "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                       "--lora-root", str(lora_root), "--max-loaded-loras", "2",
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", "256", "--block-size", "16")
    yield srv, root, keys
    assert srv.stop() == 0, srv.log()


def call(srv, method: str, path: str, key: str | None, body: dict | None = None, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, srv.url(path), headers=headers, json=body, params=params or None, timeout=60)


# (method, path, body, the role it needs) for every route the server has.
ROUTE_CALLS = [
    ("GET", "/health", None, "open"),
    ("GET", "/version", None, "open"),
    ("GET", "/openapi.json", None, "open"),
    ("GET", "/docs", None, "open"),
    ("GET", "/", None, "open"),
    ("GET", "/ui/app.js", None, "open"),
    ("GET", "/admin/tenants", None, "admin"),
    ("POST", "/v1/completions", {"model": "base", "prompt": [5, 6, 7], "max_tokens": 1}, "tenant"),
    ("POST", "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 1}, "tenant"),
    ("GET", "/v1/models", None, "tenant"),
    ("GET", "/v1/models/base", None, "tenant"),
    ("GET", "/v1/usage", None, "tenant"),
    ("POST", "/tokenize", {"model": "base", "prompt": "hello"}, "tenant"),
    ("POST", "/detokenize", {"model": "base", "tokens": [5, 6]}, "tenant"),
    ("GET", "/metrics", None, "internal"),
    ("GET", "/v1/kv_events", None, "internal"),
    ("POST", "/v1/kv_blocks", {"hashes": []}, "internal"),
    ("GET", "/v1/diagnostics", None, "internal"),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "probe", "lora_path": "missing"}, "admin"),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, "admin"),
    ("POST", "/admin/reload", None, "admin"),
    ("POST", "/v1/responses", {"model": "base", "input": "hi", "max_output_tokens": 1}, "tenant"),
    ("GET", "/v1/responses/{response_id}", None, "tenant"),
    ("DELETE", "/v1/responses/{response_id}", None, "tenant"),
    ("POST", "/v1/messages", {"model": "base", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
     "tenant"),
    ("POST", "/v1/messages/count_tokens", {"model": "base", "messages": [{"role": "user", "content": "hi"}]},
     "tenant"),
    ("POST", "/v1/embeddings", {"model": "base", "input": "hi"}, "tenant"),
]
CALLERS = {"nobody": None, "wrong key": "sk-wrong", "tenant": "sk-a", "internal": INTERNAL, "admin": ADMIN}
RANK = {"nobody": 0, "wrong key": 0, "tenant": 1, "internal": 2, "admin": 3}
NEEDS = {"open": 0, "tenant": 1, "internal": 2, "admin": 3}
# Usage is a tenant's own or, for the admin, everyone's: an internal caller has no tenant to read it for.
DENIED_BESIDES = {("internal", "/v1/usage")}


def test_every_route_has_a_role_and_each_role_is_tried(setup):
    from tokenmill.serve.roles import ROUTES, route_role

    srv, _, _ = setup
    served = set(call(srv, "GET", "/openapi.json", None).json()["paths"]) | {"/"}
    tried = {path for _, path, _, _ in ROUTE_CALLS}
    assert served <= set(ROUTES) | {"/v1/models/{model_id}"}, served - set(ROUTES)
    assert served <= tried | {"/v1/models/{model_id}", "/docs/oauth2-redirect", "/redoc"}
    for _, path, _, needs in ROUTE_CALLS:
        assert route_role(path).value == needs, path


@pytest.mark.parametrize("method, path, body, needs", ROUTE_CALLS, ids=[c[1] for c in ROUTE_CALLS])
def test_route_by_role(setup, method, path, body, needs):
    srv, root, _ = setup
    for caller, key in CALLERS.items():
        r = call(srv, method, path, key, body)
        if RANK[caller] >= NEEDS[needs] and (caller, path) not in DENIED_BESIDES:
            assert r.status_code not in (401, 403), (caller, r.status_code, r.text)
            continue
        assert r.status_code in (401, 403), (caller, r.status_code, r.text)
        if path.startswith("/v1/messages"):  # the Anthropic Messages API answers in Anthropic's error shape
            body = r.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, r.text
            assert body["error"]["type"] == {401: "authentication_error", 403: "permission_error"}[r.status_code]
        else:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
        assert "team-" not in r.text and str(root) not in r.text and "/tmp" not in r.text, r.text


def test_tenant_reads_only_its_own_usage(setup):
    srv, _, _ = setup
    assert call(srv, "POST", "/v1/completions", "sk-b", {"model": "base", "prompt": [9, 9], "max_tokens": 1}
                ).status_code == 200
    own = call(srv, "GET", "/v1/usage", "sk-a", group_by="tenant")
    assert own.status_code == 200 and {row["tenant"] for row in own.json()["data"]} <= {"team-a"}
    assert call(srv, "GET", "/v1/usage", "sk-a", tenant="team-b").status_code == 403


# ---- adapters ---------------------------------------------------------------------------------------------
def load(srv, key: str, name: str, path: str) -> httpx.Response:
    return call(srv, "POST", "/v1/load_lora_adapter", key, {"lora_name": name, "lora_path": path})


def test_tenants_cannot_load_or_unload_adapters(setup):
    srv, root, _ = setup
    for key in ("sk-a", "sk-b", INTERNAL):
        assert load(srv, key, "a-hijack", "a-private").status_code == 403
        assert call(srv, "POST", "/v1/unload_lora_adapter", key, {"lora_name": "a-private"}).status_code == 403


def test_path_probing_gets_one_answer(setup):
    srv, root, _ = setup
    probes = ["missing", "../outside", str(root / "outside"), "escape", "junk.gguf", "/etc/passwd", "/etc",
              "../../../../../../etc/hostname", "a-private/../../outside"]
    answers = {p: load(srv, ADMIN, "probe", p) for p in probes}
    for probe, r in answers.items():
        assert r.status_code == 400, (probe, r.text)
        error = r.json()["error"]
        assert error["message"] == GENERIC and error["param"] == "lora_path", (probe, r.text)
        assert "SECRET" not in r.text and str(root) not in r.text and "etc" not in r.text
    assert "probe" not in [m["id"] for m in call(srv, "GET", "/v1/models", ADMIN).json()["data"]]


def test_owned_adapter_cap_and_names_in_use(setup):
    srv, _, _ = setup
    assert load(srv, ADMIN, "a-private", "a-private").status_code == 200, "relative to --lora-root"
    body = {"model": "a-private", "prompt": [5, 17, 33], "max_tokens": 2}
    assert call(srv, "POST", "/v1/completions", "sk-a", body).status_code == 200
    for key in ("sk-b", "sk-c"):  # team-a owns a-*: to the others it does not exist
        r = call(srv, "POST", "/v1/completions", key, body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "a-private" not in [m["id"] for m in call(srv, "GET", "/v1/models", key).json()["data"]]
        assert call(srv, "GET", "/v1/models/a-private", key).status_code == 404
    # --max-loaded-loras 2
    assert load(srv, ADMIN, "spare", "spare").status_code == 200
    full = load(srv, ADMIN, "spare-2", "spare")
    assert full.status_code == 400 and "--max-loaded-loras" in full.json()["error"]["message"]
    assert call(srv, "POST", "/v1/unload_lora_adapter", ADMIN, {"lora_name": "spare"}).status_code == 200

    # A stream with a-private is running: the name is unloaded, and cannot be registered again until it ends.
    stream_body = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url("/v1/completions"), json=stream_body, timeout=60,
                      headers={"Authorization": "Bearer sk-a"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert call(srv, "POST", "/v1/unload_lora_adapter", ADMIN, {"lora_name": "a-private"}).status_code == 200
        again = load(srv, ADMIN, "a-private", "spare")
        assert again.status_code == 400 and "still running" in again.json()["error"]["message"]
    # The client left: the stream's response is done and the name frees up (within a deadline).
    deadline = time.monotonic() + 30
    while (r := load(srv, ADMIN, "a-private", "a-private")).status_code != 200 and time.monotonic() < deadline:
        assert "still running" in r.json()["error"]["message"]
    assert r.status_code == 200, r.text
    assert call(srv, "POST", "/v1/unload_lora_adapter", ADMIN, {"lora_name": "a-private"}).status_code == 200


# ---- the prefix cache -------------------------------------------------------------------------------------
def cached(srv, key: str, prompt: list[int], **extra) -> int:
    r = call(srv, "POST", "/v1/completions", key, {"model": "base", "prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def prefix_hits(srv) -> float:
    for line in call(srv, "GET", "/metrics", INTERNAL).text.splitlines():
        if line.startswith("tokenmill:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no tokenmill:prefix_cache_hits_total")


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 370 + 3 for i in range(97)]  # six full blocks of 16 and one token


def test_another_tenant_cannot_probe_a_prompt_through_the_cache(setup):
    srv, _, _ = setup
    secret = prompt(1)
    assert cached(srv, "sk-a", secret) == 0
    assert cached(srv, "sk-a", secret) >= 64  # team-a's own repeat hits
    hits = prefix_hits(srv)
    assert cached(srv, "sk-b", secret) == 0  # B computes every block of it
    assert prefix_hits(srv) == hits  # and no counter moved
    # B cannot spell team-a's salt with cache_salt, nor reach it through the admin's unsalted blocks.
    assert cached(srv, "sk-b", secret, cache_salt=json.dumps(["team-a", None])) == 0
    assert cached(srv, "sk-b", secret, cache_salt="team-a") == 0
    assert cached(srv, ADMIN, secret) == 0
    assert prefix_hits(srv) == hits


def test_a_cache_group_shares_and_cache_salt_separates(setup):
    srv, _, _ = setup
    shared = prompt(2)
    assert cached(srv, "sk-c", shared) == 0
    assert cached(srv, "sk-d", shared) >= 64  # team-c and team-d share the group "shared"
    assert cached(srv, "sk-b", shared) == 0
    assert cached(srv, "sk-c", shared, cache_salt="s1") == 0  # its own salt: its own blocks
    assert cached(srv, "sk-c", shared, cache_salt="s1") >= 64
    assert cached(srv, "sk-d", shared, cache_salt="s2") == 0
    bad = call(srv, "POST", "/v1/completions", "sk-c", {"model": "base", "prompt": shared, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_kv_routes_are_closed_to_tenants_and_events_are_salted(setup):
    srv, _, _ = setup
    secret = prompt(3)
    cached(srv, "sk-a", secret)
    for key in ("sk-a", "sk-b"):
        assert call(srv, "GET", "/v1/kv_events", key, since=-1).status_code == 403
    events = call(srv, "GET", "/v1/kv_events", INTERNAL, since=-1)
    assert events.status_code == 200
    from tokenmill.router.cache_index import prompt_hashes

    stored = set(events.json().get("stored", [])) | {h for _, kind, h in events.json().get("events", [])
                                                      if kind == "stored"}
    unsalted = {h.hex() for h in prompt_hashes(secret, 16)}
    salted = {h.hex() for h in prompt_hashes(secret, 16, json.dumps(["team-a", None]))}
    assert not unsalted & stored  # an offline guess of the text does not name any block the server holds
    assert salted <= stored  # the router, which knows the tenant, names them as the server does


# ---- reload under load ------------------------------------------------------------------------------------
def test_a_key_removed_under_load_is_refused_next(setup):
    srv, _, keys = setup
    body = {"model": "base", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=60,
                      headers={"Authorization": "Bearer sk-e"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        keys.write_text(KEYS)  # team-e removed
        assert call(srv, "POST", "/admin/reload", ADMIN).json()["tenants"] == ["team-a", "team-b", "team-c",
                                                                               "team-d"]
        rest = [line for line in lines if line]  # the stream in flight ends as it started
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    r = call(srv, "POST", "/v1/completions", "sk-e", {"model": "base", "prompt": [5], "max_tokens": 1})
    assert r.status_code == 401 and "team-e" not in r.text
    assert cached(srv, "sk-a", [5, 6, 7]) == 0  # the others go on


# ---- behind the router ------------------------------------------------------------------------------------
def test_the_router_salts_per_tenant_and_polls_with_its_internal_key(setup, tmp_path):
    """The router forwards with its backend key (the server's internal key): the tenant's salt travels in the
    body, the router's own view of the backend's cache (polled with that key) names the same salted blocks, and a
    second tenant neither hits them at the backend nor is routed as if it did."""
    from test_router import router, wait_until
    from tokenmill.router.cache_index import prompt_hashes

    srv, _, _ = setup
    keys = tmp_path / "router-keys.yaml"
    keys.write_text("tenants:\n  - {name: team-a, keys: [rk-a]}\n  - {name: team-b, keys: [rk-b]}\n")
    secret = prompt(4)
    body = {"model": "base", "prompt": secret, "max_tokens": 1}
    with router([srv.base_url], api_keys_file=str(keys), backend_api_key=INTERNAL, policy="prefix-aware",
                poll_interval_s=0.05) as (url, r):
        def send(key: str) -> int:
            got = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                             timeout=60)
            assert got.status_code == 200, got.text
            return (got.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

        assert send("rk-a") == 0
        salted = prompt_hashes(secret, 16, json.dumps(["team-a", None]))
        assert wait_until(lambda: r.cache.matched(srv.base_url, salted) == len(salted), timeout=20)
        assert r.cache.matched(srv.base_url, prompt_hashes(secret, 16)) == 0
        assert send("rk-a") >= 64
        assert send("rk-b") == 0
