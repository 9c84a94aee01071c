"""Tensor, pipeline and expert parallelism over torch.distributed (gloo, one process per rank), with the
`mp` and `ray` executors: TP=2, PP=2, EP=2 give one rank's greedy tokens and logprobs on dense and MoE models;
a worker that dies fails the in-flight requests and turns the server unhealthy, never a hang."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from compare import assert_same_outputs
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["The quick brown fox jumps over", "SELECT * FROM users WHERE", "hello", "Once upon a time " * 6]
GREEDY = SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True)
KW = dict(kv_cache_memory_bytes=8 << 20, max_model_len=256)


def generate(path, params=GREEDY, **kw):
    llm = LLM(str(path), **{**KW, **kw})
    try:
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_tp2_equals_tp1(tmp_path, arch):
    """qwen3: 4 heads and 2 KV heads split over the ranks, q/k norms, a tied (vocab-parallel) embedding;
    qwen2_moe: experts and the shared expert sharded over their intermediate dimension. (Llama runs under TP
    in the chunked/speculative test and through Ray; Mixtral under EP and PP.)"""
    path = make_tiny_model(tmp_path / arch, arch, seed=2)
    ref, _ = generate(path)
    out, llm = generate(path, tensor_parallel_size=2)
    assert_same_outputs(ref, out, f"{arch} tp=2", atol=1e-4)
    d = llm.engine.core.diagnostics()
    assert d["collectives"]["time_s"] > 0  # the all-reduces were timed


def test_tp2_chunked_sampled_and_speculative(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama", seed=3)
    kw = dict(max_num_batched_tokens=16, block_size=4)
    ref, _ = generate(path, **kw)
    out, _ = generate(path, tensor_parallel_size=2, speculative_config={"method": "ngram", "adaptive": False,
                                                                       "prompt_lookup_min": 1}, **kw)
    assert_same_outputs(ref, out, "tp=2 chunked + ngram", atol=1e-4)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    a, _ = generate(path, seeded)
    b, _ = generate(path, seeded, tensor_parallel_size=2)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tp2_draft_trees_equal_one_rank(tmp_path, method):
    """Issue 30 under tensor parallelism: every rank verifies the same tree (the core sends rank 0's drafts),
    moves the accepted path's K/V in its own shard of the heads, and (EAGLE) grows the next tree from the same
    hidden states; the tokens and logprobs equal one rank's without speculation."""
    from draft_heads_tiny import write_eagle_head
    from medusa_tiny import write_medusa

    path = make_tiny_model(tmp_path / "llama", "llama", seed=3)
    if method == "medusa":
        spec = {"method": "medusa", "model": str(write_medusa(tmp_path / "heads", path)), "num_speculative_tokens": 8}
    else:
        spec = {"method": "eagle", "model": str(write_eagle_head(tmp_path / "head", path, copy=False)),
                "num_speculative_tokens": 6, "tree_topk": 2}
    kw = dict(max_num_batched_tokens=16, block_size=4)
    ref, _ = generate(path, **kw)
    out, llm = generate(path, tensor_parallel_size=2, speculative_config={**spec, "adaptive": False}, **kw)
    assert_same_outputs(ref, out, f"tp=2 {method} trees", atol=1e-4)
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 4 * llm.engine.core.scheduler.spec_stats.num_drafts


def test_tp_with_in_process_executor_is_refused(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="'mp'"):
        LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="uni", **KW)


@pytest.mark.parametrize("mode", ["tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size"])
def test_a_dead_rank_fails_the_step_instead_of_hanging(tmp_path, mode):
    from tokenmill.executor.executor import WorkerDiedError

    path = make_tiny_model(tmp_path / "llama", "llama")
    llm = LLM(str(path), **{mode: 2}, **KW)
    engine = llm.engine
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        engine.step()
        procs = engine.core.executor.procs
        procs[1].kill()  # tp: rank 0 waits in its next all-reduce, cp in an all-gather; pp: the last stage is gone
        procs[1].join(5)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="tokenmill-worker-1"):
            for _ in range(5):
                engine.step()
        assert time.monotonic() - t0 < 10
    finally:
        engine.shutdown()


def test_the_death_error_names_every_dead_rank_whichever_pipe_closed_first():
    """Rank 1 is killed; rank 0 then fails its next collective and exits, so rank 0's pipe may close before the
    executor notices rank 1: the error must still name rank 1 (CI saw "worker-0 died" alone)."""
    from tokenmill.executor.executor import MultiprocExecutor, WorkerDiedError

    class Proc:
        def __init__(self, name, exitcode, reaped_after):
            self.name, self._exitcode, self._polls = name, exitcode, reaped_after

        def is_alive(self):
            self._polls -= 1
            return self._polls >= 0

        @property
        def exitcode(self):
            return self._exitcode if self._polls < 0 else None

    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    ex.procs = [Proc("tokenmill-worker-0", 0, reaped_after=3), Proc("tokenmill-worker-1", -9, reaped_after=0)]
    err = ex._died(ex.procs[0])
    assert isinstance(err, WorkerDiedError)
    assert "tokenmill-worker-1 (exit code -9)" in str(err) and "tokenmill-worker-0" in str(err)


# ---- the server -------------------------------------------------------------------------------------
def test_killing_a_worker_under_load_fails_requests_and_health(tmp_path):
    from server_harness import spawned_children, start_server

    path = make_tiny_model(tmp_path / "llama", "llama", hidden_size=128, intermediate_size=256,
                           num_hidden_layers=4)
    srv = start_server(path, tmp_path / "server.log", "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", "512")
    try:
        assert httpx.get(srv.url("/health"), timeout=5).status_code == 200
        (core,) = spawned_children(srv.proc.pid)
        deadline = time.monotonic() + 30
        while len(spawned_children(core)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = spawned_children(core)
        assert len(workers) == 2, workers
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        client = httpx.Client(base_url=srv.base_url, timeout=30)
        sinks, threads, started = [], [], []
        for _ in range(2):
            first, sink = threading.Event(), []

            def stream(sink=sink, first=first):
                with client.stream("POST", "/v1/completions", json=body) as r:
                    sink.append(r.status_code)
                    for line in r.iter_lines():
                        if line:
                            sink.append(line)
                            first.set()

            t = threading.Thread(target=stream, daemon=True)
            t.start()
            sinks.append(sink)
            threads.append(t)
            started.append(first)
        for first in started:
            assert first.wait(30), "no stream started"
        os.kill(workers[-1], signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request hung after a worker died"
        for sink in sinks:
            payloads = [line.removeprefix("data: ") for line in sink[1:]]
            assert payloads[-1] == "[DONE]"
            assert "error" in json.loads(payloads[-2])
        deadline = time.monotonic() + 10
        while httpx.get(srv.url("/health"), timeout=5).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(srv.url("/health"), timeout=5).status_code == 503
        late = client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert late.status_code == 503
        client.close()
    finally:
        srv.stop(signal.SIGKILL)


# ---- Ray ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_tp2_equals_tp1(tmp_path, ray_local):
    path = make_tiny_model(tmp_path / "llama", "llama", seed=2)
    ref, _ = generate(path)
    out, _ = generate(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert_same_outputs(ref, out, "ray tp=2", atol=1e-4)


def test_ray_dead_actor_fails_the_step(tmp_path, ray_local):
    from tokenmill.executor.executor import WorkerDiedError

    path = make_tiny_model(tmp_path / "llama", "llama")
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    engine = llm.engine
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        ray_local.kill(engine.core.executor.actors[1])
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError):
            for _ in range(5):
                engine.step()
        assert time.monotonic() - t0 < 30
    finally:
        engine.shutdown()


# ---- expert parallelism ------------------------------------------------------------------------------
def test_expert_parallel_ranks_sum_to_the_whole_layer():
    """Two FusedMoE halves (ep_rank 0 and 1 of 2) hold experts 0-3 and 4-7 whole; their partial outputs
    add up to the one-rank layer's, for batch-1 and grouped paths."""
    import torch

    from tokenmill.layers.moe import FusedMoE, route

    torch.manual_seed(0)
    E, H, I = 8, 16, 24
    w13 = torch.randn(E, 2 * I, H) * 0.2
    w2 = torch.randn(E, H, I) * 0.2
    whole = FusedMoE(E, H, I)
    halves = [FusedMoE(E, H, I, ep_rank=r, ep_size=2) for r in range(2)]
    for layer in [whole, *halves]:
        for e in range(E):
            layer.weight_loader(layer.w13_weight, w13[e, :I], (e, "w1"))
            layer.weight_loader(layer.w13_weight, w13[e, I:], (e, "w3"))
            layer.weight_loader(layer.w2_weight, w2[e], (e, "w2"))
    assert halves[0].w13_weight.shape[0] == 4 and halves[1].unloaded() == []
    for T in (1, 5):
        x = torch.randn(T, H)
        weights, ids = route(torch.randn(T, E), 2, True)
        ref = whole(x, weights, ids)
        parts = sum(h(x, weights, ids) for h in halves)
        torch.testing.assert_close(parts, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2_moe"])
def test_ep2_equals_ep1(tmp_path, arch):
    path = make_tiny_model(tmp_path / arch, arch, seed=4)
    ref, _ = generate(path)
    out, _ = generate(path, tensor_parallel_size=2, enable_expert_parallel=True)
    assert_same_outputs(ref, out, f"{arch} ep=2", atol=1e-4)


# ---- pipeline parallelism ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_pp2_equals_pp1(tmp_path, arch):
    """Two stages of one layer each; qwen3's tied head needs the embedding on the last stage too. Prompt
    logprobs and sampled logprobs come from the last stage."""
    path = make_tiny_model(tmp_path / arch, arch, seed=5)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    ref, _ = generate(path, params)
    out, llm = generate(path, params, pipeline_parallel_size=2)
    assert_same_outputs(ref, out, f"{arch} pp=2", atol=1e-4)
    assert llm.engine.core.diagnostics()["collectives"]["time_s"] > 0


@pytest.mark.parametrize("mode", ["chunked", "preempted", "pp2xtp2"])
def test_pp2_modes(tmp_path, mode):
    path = make_tiny_model(tmp_path / "llama", "llama", seed=6)
    kw = {"chunked": dict(max_num_batched_tokens=16, block_size=4),
          "preempted": dict(num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=32, max_model_len=160,
                            kv_cache_memory_bytes=None),
          "pp2xtp2": dict(tensor_parallel_size=2, max_num_batched_tokens=24)}[mode]
    ref, _ = generate(path, **kw)
    out, llm = generate(path, pipeline_parallel_size=2, **kw)
    assert_same_outputs(ref, out, f"pp=2 {mode}", atol=1e-4)
    if mode == "preempted":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_micro_batches_split_by_tokens_in_order():
    from tokenmill.core.batch import ScheduledBatch
    from tokenmill.executor.model_runner import micro_batches

    b = ScheduledBatch(["a", "b", "c", "d"], [30, 1, 1, 8], [1, 1, 4, 1], spec_token_ids={"c": [5, 6, 7]},
                       prompt_logprob_ranges={"a": (0, 29)})
    one, two = micro_batches(b, 2)
    assert one.req_ids == ["a"] and two.req_ids == ["b", "c", "d"]
    assert two.spec_token_ids == {"c": [5, 6, 7]} and one.prompt_logprob_ranges == {"a": (0, 29)}
    assert two.num_sample_rows == [1, 4, 1] and one.num_tokens + two.num_tokens == b.num_tokens
    assert micro_batches(ScheduledBatch(["x"], [3], [1]), 2)[0].req_ids == ["x"]


def test_pp_with_speculative_decoding_is_refused(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="pipeline parallelism"):
        LLM(str(path), pipeline_parallel_size=2, speculative_config={"method": "ngram"}, **KW)


def test_ray_pp2_and_ep2(tmp_path, ray_local):
    path = make_tiny_model(tmp_path / "mixtral", "mixtral", seed=7)
    ref, _ = generate(path)
    for kw in (dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        out, _ = generate(path, distributed_executor_backend="ray", **kw)
        assert_same_outputs(ref, out, f"ray {kw}", atol=1e-4)


@pytest.mark.parametrize("how", ["pp2-plain", "tp2-with", "tp2-plain", "cli-pp2"])
def test_a_script_with_worker_processes_exits_on_its_own(tmp_path, how):
    """issue 25: a script using `mp` tensor or pipeline parallelism printed its answer and then hung in
    multiprocessing's exit hook (the workers waited on a pipe nobody closed), as did `tokenmill generate -pp 2`."""
    import subprocess
    import sys

    path = make_tiny_model(tmp_path / "llama", "llama")
    size = "pipeline_parallel_size" if how.startswith("pp") else "tensor_parallel_size"
    make = f"LLM({str(path)!r}, {size}=2, kv_cache_memory_bytes=8 << 20, max_model_len=256)"
    run = "print(llm.generate(['hello'], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids)"
    if how == "cli-pp2":
        cmd = [sys.executable, "-m", "tokenmill", "generate", str(path), "-pp", "2", "--prompt", "hello",
               "--max-tokens", "4", "--kv-cache-memory-bytes", "8M", "--max-model-len", "256"]
    else:
        body = f"llm = {make}\n{run}" if how.endswith("plain") else f"with {make} as llm:\n    {run}"
        cmd = [sys.executable, "-c", "from tokenmill import LLM, SamplingParams\n" + body + "\n"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]


def test_workers_stop_when_the_llm_is_collected(tmp_path):
    import gc

    llm = LLM(str(make_tiny_model(tmp_path / "llama", "llama")), pipeline_parallel_size=2, **KW)
    procs = list(llm.engine.core.executor.procs)
    assert all(p.is_alive() for p in procs)
    del llm
    gc.collect()
    deadline = time.monotonic() + 30
    while any(p.is_alive() for p in procs):
        assert time.monotonic() < deadline, "worker processes outlived their LLM"
        time.sleep(0.05)
