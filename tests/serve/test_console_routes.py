"""The console's routes without a browser (these run where no Chromium is installed): `/` answers the page to a
browser and JSON to API clients (model names only on a server without keys), the static files are a fixed set
served with a same-origin-only CSP and reference nothing off the server, `--no-ui` turns them off while /v1 stays,
and GET /admin/tenants reports each tenant's limits and which it is at."""
from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from server_harness import start_server
from tiny import make_tiny_model
from tokenmill.serve.routes.tenant_status import tenant_status
from tokenmill.serve.routes.ui import STATIC, static_files
from tokenmill.serve.tenants.keys import Tenant, TenantLimits
from tokenmill.serve.tenants.limits import TenantLimiter


def test_static_files_reference_only_the_server():
    files = static_files()
    assert {"index.html", "app.js", "api.js", "chat.js", "live.js", "usage.js", "bench.js", "markdown.js",
            "plot.js", "prom.js", "style.css"} <= set(files)
    for name, path in files.items():
        text = path.read_text()
        assert not re.search(r"https?://", text), name  # no CDN, no fetch elsewhere
        for ref in re.findall(r"""(?:src|href)="(/[^"]*)"|from "(/[^"]*)"|import\("(/[^"]*)"\)""", text):
            target = next(r for r in ref if r)
            assert target.startswith("/ui/") and target[4:] in files, (name, target)
    pyproject = (STATIC.parents[3] / "pyproject.toml").read_text()
    assert '"serve/ui/static/*"' in pyproject  # shipped in the wheel


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_tenant_status_says_which_limits_a_tenant_is_at():
    clock = Clock()
    limiter = TenantLimiter(clock=clock, wall=lambda: 86400 * 100 + 5)
    t = Tenant("t", limits=TenantLimits(requests_per_minute=2, tokens_per_minute=100, concurrent=2,
                                        tokens_per_day=150))
    fresh = tenant_status(limiter, t)
    assert fresh["at_limit"] == [] and fresh["in_flight"] == 0
    assert fresh["requests_left_this_minute"] == 2 and fresh["tokens_left_this_minute"] == 100
    assert limiter.admit(t) is None and limiter.admit(t) is None  # two sequences: both slots, both requests
    busy = tenant_status(limiter, t)
    assert busy["in_flight"] == 2 and busy["requests_left_this_minute"] == 0
    assert busy["at_limit"] == ["concurrent", "requests_per_minute"]
    assert limiter.admit(t) is not None  # the limiter agrees: the next one is refused
    limiter.release(t, 2)
    clock.t += 30  # half a minute refills one request
    assert tenant_status(limiter, t)["at_limit"] == [] and tenant_status(limiter, t)["requests_left_this_minute"] == 1
    r = limiter.reserve(t, 100, lambda: 160)
    limiter.settle(r)  # used 160: the minute's bucket in debt, the day's 150 spent
    status = tenant_status(limiter, t)
    assert status["tokens_left_this_minute"] == -60 and status["tokens_today"] == 160
    assert status["at_limit"] == ["tokens_per_minute", "tokens_per_day"]
    assert limiter.buckets["t"].last == 1000.0  # reading the status refilled a copy, not the limiter's bucket


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("console-routes")
    keys = root / "keys.yaml"
    keys.write_text("tenants:\n  - {name: team-a, keys: [sk-a], limits: {concurrent: 1}}\n")
    model = make_tiny_model(root / "tiny", "llama", max_position_embeddings=2048)
    srv = start_server(model, root / "server.log", "--served-model-name", "tiny", "--api-keys-file", str(keys),
                       "--admin-key", "sk-admin", "--max-model-len", "2048", "--kv-cache-memory-bytes", "16M")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_root_is_the_page_for_browsers_and_json_for_clients(server):
    page = httpx.get(server.url("/"), headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="/ui/app.js">' in page.text
    info = httpx.get(server.url("/")).json()
    assert info["name"] == "tokenmill" and info["console"] == "/ui/"
    assert "models" not in info  # a keyed server's model names stay behind /v1/models
    js = httpx.get(server.url("/ui/chat.js"))
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    for bad in ("/ui/..%2Fapp.py", "/ui/__init__.py", "/ui/missing.js"):
        assert httpx.get(server.url(bad)).status_code == 404, bad
    assert httpx.get(server.url("/v1/models")).status_code == 401  # the data routes keep their keys


def test_admin_tenants_shows_who_is_at_a_limit(server):
    admin = {"Authorization": "Bearer sk-admin"}
    assert httpx.get(server.url("/admin/tenants"), headers={"Authorization": "Bearer sk-a"}).status_code == 403
    idle = httpx.get(server.url("/admin/tenants"), headers=admin).json()["data"]
    assert idle == [{"tenant": "team-a", "limits": {"requests_per_minute": None, "tokens_per_minute": None,
                                                      "concurrent": 1, "tokens_per_day": None},
                     "in_flight": 0, "at_limit": [], "requests_left_this_minute": None,
                     "tokens_left_this_minute": None, "tokens_today": None}]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60,
                      headers={"Authorization": "Bearer sk-a"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a generator closed early would close the response
        assert next(line for line in lines if line.startswith("data: {"))
        busy = httpx.get(server.url("/admin/tenants"), headers=admin).json()["data"][0]
        assert busy["in_flight"] == 1 and busy["at_limit"] == ["concurrent"]
    deadline = time.monotonic() + 30  # the client left: its slot comes back
    while httpx.get(server.url("/admin/tenants"), headers=admin).json()["data"][0]["in_flight"]:
        assert time.monotonic() < deadline, "the slot was not released"
        time.sleep(0.05)


def test_no_ui_turns_the_console_off(tmp_path):
    srv = start_server(make_tiny_model(tmp_path / "tiny", "llama"), tmp_path / "server.log", "--no-ui",
                       "--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory-bytes", "8M")
    try:
        page = httpx.get(srv.url("/"), headers={"Accept": "text/html"})
        assert page.headers["content-type"].startswith("application/json")
        assert page.json() == {"name": "tokenmill", "version": page.json()["version"], "models": ["tiny"]}
        assert httpx.get(srv.url("/ui/app.js")).status_code == 404
        assert httpx.get(srv.url("/ui/")).status_code == 404
        assert httpx.get(srv.url("/v1/models")).json()["data"][0]["id"] == "tiny"
    finally:
        assert srv.stop() == 0, srv.log()
