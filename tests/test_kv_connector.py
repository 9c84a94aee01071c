"""Disaggregated prefill/decode through the shared-storage KV connector: a producer's prompt KV, loaded by a
consumer instead of computed, gives exactly the output of one engine; a corrupt block is recomputed."""
from __future__ import annotations

import json
import os

import pytest

from compare import assert_same_outputs
from tokenmill import LLM, SamplingParams
from tokenmill.config import KVTransferConfig

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "SELECT * FROM users WHERE id = 42; " * 4, "hello"]
KW = dict(kv_cache_memory_bytes=8 << 20, block_size=4)


def transfer(role: str, path) -> dict:
    return {"kv_role": role, "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, n=2)
    return params, LLM(str(tiny_llama), **KW).generate(PROMPTS, params, use_tqdm=False)


def prefill(model, path) -> LLM:
    producer = LLM(str(model), kv_transfer_config=transfer("kv_producer", path), **KW)
    producer.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)
    return producer


def test_decode_instance_loads_the_prefill_and_matches_one_engine(tiny_llama, baseline, tmp_path):
    params, ref = baseline
    producer = prefill(tiny_llama, tmp_path)
    assert producer.engine.core.scheduler_stats().kv_transfer["exported_blocks"] > 20
    consumer = LLM(str(tiny_llama), kv_transfer_config=transfer("kv_consumer", tmp_path), **KW)
    out = consumer.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ref, out):
        assert_same_outputs(a.outputs, b.outputs, "pd")
    kt = consumer.engine.core.scheduler_stats().kv_transfer
    assert kt["imported_blocks"] > 20 and kt["import_failures"] == 0 and kt["bytes"] > 0
    assert consumer.engine.core.scheduler_stats().prefix_hits > 0
    # The files were read in the background while the request waited; the admitting step only copied them.
    assert consumer.engine.core.executor.worker.connector.from_memory == kt["imported_blocks"]


def test_corrupt_or_missing_blocks_are_recomputed(tiny_llama, baseline, tmp_path):
    params, ref = baseline
    prefill(tiny_llama, tmp_path)
    files = sorted(os.listdir(tmp_path))
    for name in files[:: 3]:  # flip a byte near the end (block data) of every third file
        path = tmp_path / name
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    consumer = LLM(str(tiny_llama), kv_transfer_config=transfer("kv_consumer", tmp_path), **KW)
    out = consumer.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ref, out):
        assert_same_outputs(a.outputs, b.outputs, "pd corrupt")
    assert consumer.engine.core.scheduler_stats().kv_transfer["import_failures"] > 0
    empty = LLM(str(tiny_llama), kv_transfer_config=transfer("kv_consumer", tmp_path / "none"), **KW)
    out = empty.generate(PROMPTS, params, use_tqdm=False)  # nothing handed over: computed as usual
    for a, b in zip(ref, out):
        assert_same_outputs(a.outputs, b.outputs, "pd nothing")


@pytest.mark.parametrize("bad, message", [
    ('{"kv_role": "kv_sender"}', "kv_role"),
    ('{"kv_role": "kv_both", "kv_connector": "NixlConnector"}', "not available"),
    ('{"kv_role": "kv_both", "colour": 1}', "unknown kv_transfer_config keys"),
    ("[1]", "JSON object"),
])
def test_bad_kv_transfer_config(bad, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(bad)


def test_kv_transfer_needs_prefix_caching(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(str(tiny_llama), kv_transfer_config=transfer("kv_both", tmp_path), enable_prefix_caching=False, **KW)


def test_tcp_connector_pulls_blocks_from_a_producer_server(tiny_llama, baseline, tmp_path):
    """Another node: the consumer pulls the prompt's blocks from the producer's POST /v1/kv_blocks into its
    own folder, then loads them."""
    import signal

    import httpx

    from server_harness import start_server

    params, ref = baseline
    producer = start_server(tiny_llama, tmp_path / "producer.log", "--block-size", "4", "--kv-cache-memory-bytes",
                            "8M", "--no-engine-core-process", "--api-key", "k", "--kv-transfer-config",
                            json.dumps(transfer("kv_producer", tmp_path / "producer-store")), api_key="k")
    try:
        for p in PROMPTS:
            r = httpx.post(producer.url("/v1/completions"), json={"prompt": p, "max_tokens": 1},
                           headers={"Authorization": "Bearer k"}, timeout=60)
            assert r.status_code == 200, r.text
        cfg = {"kv_role": "kv_consumer", "kv_connector": "TCPConnector",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "consumer-store"),
                                             "producers": [producer.base_url], "api_key": "k"}}
        consumer = LLM(str(tiny_llama), kv_transfer_config=cfg, **KW)
        out = consumer.generate(PROMPTS, params, use_tqdm=False)
        for a, b in zip(ref, out):
            assert_same_outputs(a.outputs, b.outputs, "pd over tcp")
        kt = consumer.engine.core.scheduler_stats().kv_transfer
        assert kt["imported_blocks"] > 20 and kt["import_failures"] == 0
        assert consumer.engine.core.kv.connector.stats.pulled_bytes > 0
        bad = httpx.post(producer.url("/v1/kv_blocks"), json={"hashes": "x"}, headers={"Authorization": "Bearer k"})
        assert bad.status_code == 400
        assert httpx.post(producer.url("/v1/kv_blocks"), json={"hashes": []}).status_code == 401  # needs the key
    finally:
        producer.stop(signal.SIGKILL)
