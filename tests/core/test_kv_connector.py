"""Disaggregated prefill/decode through the shared-storage KV connector: a producer's prompt KV, loaded by a
consumer instead of computed, gives exactly the output of one engine; a corrupt block is recomputed."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch

from compare import assert_same_outputs
from tokenmill import LLM, SamplingParams
from tokenmill.config import KVTransferConfig, SchedulerConfig
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.kv_connector import ExportOp, SharedStorageConnector, TCPConnector
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor.kv_connector import ConnectorWorker

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


# ---- no network I/O in schedule(); bounded staging ------------------------------------------------------
class SilentPeer:
    """A "producer" that accepts TCP connections and never answers; close() makes it die (resets them)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.conns: list[socket.socket] = []
        self.accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def within(fn, seconds: float = 60.0):
    """fn()'s result; fails if it has not returned within `seconds` (it would be blocked on the peer)."""
    result, done = [], threading.Event()

    def run():
        result.append(fn())
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(seconds), f"{fn} did not return within {seconds} s"
    return result[0]


def consumer_scheduler(connector) -> Scheduler:
    kv = KVCacheManager(64, 4, True, None, connector)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), kv, 256)


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(), max_tokens=4)


def admitted(out) -> dict[str, int]:
    """Request id -> tokens scheduled, for the requests given tokens to compute."""
    return {r.request_id: n for r, n in out.scheduled if n}


def test_tcp_lookup_waits_in_the_background_and_a_dead_peer_falls_back_to_local_compute(tmp_path):
    """A producer that never answers (an hour's timeout): schedule() returns at once, the request whose
    blocks are being asked for waits in the queue while a short one runs, and once the peer dies it computes
    its prompt locally."""
    peer = SilentPeer()
    try:
        connector = TCPConnector(str(tmp_path), "kv_consumer", producers=[peer.url], timeout_s=3600)
        sched = consumer_scheduler(connector)
        sched.add_request(request("long", 40))  # 9 full blocks the producer might hold
        sched.add_request(request("short", 3))  # no full block: nothing to ask for
        assert admitted(within(sched.schedule)) == {"short": 3}
        assert peer.accepted.wait(60)  # the pull is in flight, unanswered
        assert "long" not in admitted(within(sched.schedule))
        assert connector.pending  # the engine sleeps between steps rather than spinning
        peer.close()  # the peer dies: the pull fails, the producer is skipped for retry_s
        assert connector.wait_lookups(60)
        assert admitted(within(sched.schedule)).get("long") == 40  # its whole prompt, computed here
        assert sched.requests["long"].num_cached_tokens == 0 and not connector.pending
        sched.add_request(request("next", 40))  # the dead producer is not asked again: admitted at once
        assert "next" in admitted(within(sched.schedule))
    finally:
        peer.close()


def test_tcp_lookup_of_a_slow_peer_times_out(tmp_path):
    peer = SilentPeer()
    try:
        connector = TCPConnector(str(tmp_path), "kv_consumer", producers=[peer.url], timeout_s=0.2)
        sched = consumer_scheduler(connector)
        sched.add_request(request("a", 40))
        assert admitted(within(sched.schedule)) == {}
        assert connector.wait_lookups(60)  # bounded by timeout_s, though the peer never answers
        assert admitted(within(sched.schedule)) == {"a": 40}
    finally:
        peer.close()


def test_llm_with_a_dead_kv_peer_computes_locally(tiny_llama, baseline, tmp_path):
    params, ref = baseline
    peer = SilentPeer()
    try:
        cfg = {"kv_role": "kv_consumer", "kv_connector": "TCPConnector",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path), "producers": [peer.url],
                                             "timeout_s": 0.2}}
        consumer = LLM(str(tiny_llama), kv_transfer_config=cfg, **KW)
        out = consumer.generate(PROMPTS, params, use_tqdm=False)
        for a, b in zip(ref, out):
            assert_same_outputs(a.outputs, b.outputs, "dead peer")
        assert peer.accepted.is_set()
        assert consumer.engine.core.scheduler_stats().kv_transfer["imported_blocks"] == 0
    finally:
        peer.close()


def exported_blocks(tmp_path, n: int):
    """A worker over one layer's K/V (8 blocks of 4 tokens) whose first n blocks are written as files."""
    caches = [torch.randn(8, 4, 2, 8) for _ in range(2)]
    worker = ConnectorWorker(caches, str(tmp_path))
    hashes = [bytes([i + 1]) * 32 for i in range(n)]
    worker.export([ExportOp(b, h) for b, h in enumerate(hashes)])
    return worker, caches, hashes


def test_staged_rows_dropped_past_the_cap_still_admit_their_request(tmp_path):
    """Background reads keep at most max_staged rows; rows dropped before their import count as read (the
    request is admitted, never waits for them) and are read from their files in the step."""
    worker, caches, hashes = exported_blocks(tmp_path, 5)
    expected = [c[:5].clone() for c in caches]
    worker.max_staged = 2  # smaller than the chain: its first rows are dropped before the import
    core = SharedStorageConnector(str(tmp_path), "kv_consumer")
    assert core.lookup(hashes) == hashes
    assert not core.admissible("r", hashes)
    for op in core.take_imports():
        worker.prefetch(op)
    assert worker.wait_prefetched(60)
    core.mark_read(set(worker.finished(core.pending_hashes())))
    assert core.admissible("r", hashes) and not core.pending
    core.admitted("r")
    for c in caches:
        c.zero_()
    for i, h in enumerate(hashes):
        core.load(h, 3 + i)  # into blocks 3..7
    assert worker.load(core.take_imports()) == []
    assert worker.from_memory == 2  # the rows still staged; the dropped ones were read in the step
    for c, e in zip(caches, expected):
        assert torch.equal(c[3:8], e)


def test_read_reports_accumulate(tmp_path):
    """A hash reported read once counts even if later reports leave it out (its row was dropped since)."""
    core = SharedStorageConnector(str(tmp_path), "kv_consumer")
    chain = [bytes([i]) * 32 for i in range(3)]
    assert not core.admissible("r", chain)
    core.mark_read({chain[0], chain[1]})
    assert not core.admissible("r", chain) and core.pending_hashes() == [chain[2]]
    core.mark_read({chain[2]})
    assert core.admissible("r", chain)


def test_a_request_never_waits_longer_than_read_wait_s(tmp_path):
    core = SharedStorageConnector(str(tmp_path), "kv_consumer", read_wait_s=0.0)
    chain = [b"\x01" * 32]
    assert not core.admissible("r", chain)
    deadline = time.monotonic() + 60
    while not core.admissible("r", chain):  # no report ever comes: admitted once read_wait_s has passed
        assert time.monotonic() < deadline
    assert not core.pending
