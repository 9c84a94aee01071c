"""KV offloading behind the server: evicted prefix blocks come back from the host and disk tiers,
and the counters show it in /metrics and in usage.cached_tokens."""
from __future__ import annotations

import httpx
import pytest

from server_harness import start_server
from tiny import make_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    model = make_tiny_model(root / "m", "llama")
    # 24 blocks of 16 tokens: a few 120-token prompts evict each other's prefixes.
    s = start_server(model, root / "server.log", "--num-gpu-blocks-override", "24", "--max-model-len", "256",
                     "--kv-offload-bytes", "64K", "--kv-offload-dir", str(root / "kv"),
                     "--kv-offload-min-blocks", "1", "--served-model-name", "tiny")
    yield s
    s.stop()


def complete(server, ids):
    r = httpx.post(server.url("/v1/completions"), json={"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                        "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_offloaded_prefix_is_loaded_back(server):
    prompts = [[(7 * i + j) % 300 + 5 for j in range(120)] for i in range(6)]
    first = [complete(server, p) for p in prompts]
    again = complete(server, prompts[0])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
    m = server.metrics()
    assert m["tokenmill:prefix_cache_evictions_total"] > 0
    assert m["tokenmill:kv_offload_saves_total"] > 0
    loads = m['tokenmill:kv_offload_loads_total{tier="host"}'] + m['tokenmill:kv_offload_loads_total{tier="disk"}']
    assert loads > 0
    assert m["tokenmill:kv_offload_load_failures_total"] == 0
