"""SLO targets have a floor (--min-slo-ttft-ms, default 50): a request asking for a tighter TTFT gets 400 naming
`slo.ttft_ms` (refused, not clamped: the caller learns its target is not what it asked for). Before, one
`slo.ttft_ms: 0.001` request (no keys needed) was shed yet held every batch step at 32 tokens for 10 s; that
the policy forgets shed and hopeless requests is test_policies.py's
test_a_hopeless_slo_request_leaves_no_trace_in_the_step_size."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import httpx
import pytest

from server_harness import start_server
from tiny import make_tiny_model
from tokenmill.serve.errors import APIError
from tokenmill.serve.tenants.keys import request_slo


def test_request_slo_floor():
    asked = SimpleNamespace(ttft_ms=0.001, tpot_ms=None)
    with pytest.raises(APIError) as e:
        request_slo(asked, 50.0)
    assert e.value.status == 400 and e.value.param == "slo.ttft_ms" and "at least 50 ms" in e.value.message
    assert request_slo(asked, 0.0).ttft_ms == 0.001  # --min-slo-ttft-ms 0: any positive target
    assert request_slo(SimpleNamespace(ttft_ms=50.0, tpot_ms=5.0), 50.0).ttft_ms == 50.0  # the floor itself
    assert request_slo(SimpleNamespace(ttft_ms=None, tpot_ms=5.0), 50.0).tpot_ms == 5.0
    assert request_slo(None, 50.0) is None


@pytest.fixture(scope="module")
def slo_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slo_floor")
    base = make_tiny_model(tmp / "base", "llama")
    srv = start_server(base, tmp / "server.log", "--served-model-name", "base", "--scheduling-policy", "slo",
                       "--slo-shed", "--kv-cache-memory-bytes", "16M", "--max-model-len", "256")
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_ttft_below_the_floor_is_a_400_naming_the_field(slo_server, path):
    body = {"model": "base", "max_tokens": 2}
    body.update({"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(slo_server.url(path), json={**body, "slo": {"ttft_ms": 0.001}}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "slo.ttft_ms" and err["type"] == "invalid_request_error"
    assert err["code"] == "slo_below_floor" and "--min-slo-ttft-ms" in err["message"]
    r = httpx.post(slo_server.url(path), json={**body, "slo": {"ttft_ms": 60000, "tpot_ms": 60000}}, timeout=60)
    assert r.status_code == 200, r.text
