"""The step contract across a process boundary: the same pickled batches, run by a worker in this process
and by a worker process (multiprocess executor, torch.distributed gloo), give the same outputs."""
from __future__ import annotations

import pickle

import pytest
import torch

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor.executor import Executor, MultiprocExecutor, UniProcExecutor, WorkerDiedError

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("executor") / "qwen3", "qwen3")


def config(path, backend: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(path), max_model_len=64),
        cache=CacheConfig(num_gpu_blocks_override=24, block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8),
        parallel=ParallelConfig(distributed_executor_backend=backend),
    )


def record_batches(path) -> list[bytes]:
    """Drive a scheduler over mixed requests (chunked prompts, prompt logprobs, seeds, n>1 children,
    a preemption) with an in-process worker; return every step's batch, pickled."""
    ex = UniProcExecutor(config(path))
    kv = KVCacheManager(ex.info.num_blocks, ex.info.block_size, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8), kv, 64)
    g = torch.Generator().manual_seed(0)
    specs = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
             SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, prompt_logprobs=2),
             SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=14, repetition_penalty=1.3),
             SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4)]
    for i in range(7):
        prompt = torch.randint(1, 300, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        p = specs[i % len(specs)]
        sched.add_request(Request(f"r{i}", prompt, p, p.max_tokens, frozenset({2}), index=0,
                                  seed=None if p.seed is None else p.seed + i))
    batches = []
    while sched.has_unfinished():
        out = sched.schedule()
        if not out:
            continue
        batch = sched.build_batch(out)
        blob = pickle.dumps(batch)
        batches.append(blob)
        sched.update_from_output(out, ex.execute_model(pickle.loads(blob)))
    assert sched.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    batches.append(pickle.dumps(ScheduledBatch(finished_req_ids=sched._forget)))
    ex.shutdown()
    return batches


def replay(ex: Executor, batches: list[bytes]) -> list[ModelRunnerOutput]:
    return [ex.execute_model(pickle.loads(b)) for b in batches]


def assert_same(a: list[ModelRunnerOutput], b: list[ModelRunnerOutput]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.req_ids == y.req_ids and x.sampled_token_ids == y.sampled_token_ids
        assert x.logprobs.keys() == y.logprobs.keys() and x.prompt_logprobs.keys() == y.prompt_logprobs.keys()
        for rid in x.logprobs:
            for (lp1, r1, ids1, tops1), (lp2, r2, ids2, tops2) in zip(x.logprobs[rid], y.logprobs[rid]):
                assert r1 == r2 and ids1 == ids2 and lp1 == pytest.approx(lp2, abs=1e-5)
        for rid, p in x.prompt_logprobs.items():
            q = y.prompt_logprobs[rid]
            assert (p.first_pos, p.token_ids, p.ranks, p.top_ids) == (q.first_pos, q.token_ids, q.ranks, q.top_ids)
            assert p.logprobs == pytest.approx(q.logprobs, abs=1e-5)


def test_pickled_batches_give_the_same_output_in_a_worker_process(path):
    batches = record_batches(path)
    assert len(batches) > 10
    local = UniProcExecutor(config(path))
    expected = replay(local, batches)
    local.shutdown()
    assert any(o.sampled_token_ids for o in expected) and any(o.prompt_logprobs for o in expected)
    remote = MultiprocExecutor(config(path, "mp"))
    try:
        got = replay(remote, batches)
        remote.check_health()
    finally:
        remote.shutdown()
    assert_same(expected, got)
    assert all(not p.is_alive() for p in remote.procs)


def test_llm_with_a_worker_process_matches_in_process(path):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
    sp = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=2),
          SamplingParams(temperature=0.9, seed=3, max_tokens=8, n=2),
          SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1)]
    kw = dict(max_model_len=128, num_gpu_blocks_override=32, block_size=4)
    ref = LLM(str(path), **kw).generate(prompts, sp, use_tqdm=False)
    mp_llm = LLM(str(path), distributed_executor_backend="mp", **kw)
    try:
        out = mp_llm.generate(prompts, sp, use_tqdm=False)
    finally:
        mp_llm.engine.shutdown()
    for a, b in zip(ref, out):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
    assert ref[2].prompt_logprobs is not None and len(ref[2].prompt_logprobs) == len(out[2].prompt_logprobs)


def test_a_dead_worker_fails_the_call_instead_of_hanging(path):
    ex = MultiprocExecutor(config(path, "mp"))
    try:
        ex.procs[0].kill()
        ex.procs[0].join(5)
        with pytest.raises(WorkerDiedError):
            ex.execute_model(ScheduledBatch())
        with pytest.raises(WorkerDiedError):
            ex.check_health()
    finally:
        ex.shutdown()


def test_several_ranks_in_one_process_are_refused_clearly(path):
    with pytest.raises(ValueError, match="'mp'"):
        LLM(str(path), pipeline_parallel_size=2, distributed_executor_backend="uni", max_model_len=128,
            num_gpu_blocks_override=32)


def test_drafts_verified_by_the_runner_never_change_greedy_output(path):
    """Speculative rows through the real runner and attention: drafts that are right, wrong or half
    right are verified in one forward, rejected slots rolled back, and the greedy output is unchanged."""
    prompts = [[5, 6, 7, 8, 9], list(range(30, 52)), [100, 101, 102]]
    sp = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1)
    llm = LLM(str(path), max_model_len=64, num_gpu_blocks_override=40, block_size=4)
    ref = llm.generate(prompts, sp, use_tqdm=False)
    want = {str(i): list(p) + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, ref))}
    engine, rng = llm.engine, torch.Generator().manual_seed(1)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, sp)
    got, proposed, accepted = {}, 0, 0
    while engine.has_unfinished_requests():
        for req in engine.scheduler.running:
            if req.num_uncomputed_tokens == 1:
                true = want[req.request_id[1:]][req.num_tokens : req.num_tokens + 4]
                kind = int(torch.randint(0, 3, (1,), generator=rng))
                cut = int(torch.randint(0, len(true) + 1, (1,), generator=rng)) if kind == 2 else len(true)
                req.spec_token_ids = true if kind == 0 else [(t + 1) % 300 for t in true] if kind == 1 else \
                    true[:cut] + [(t + 7) % 300 for t in true[cut:]]
                proposed += len(req.spec_token_ids)
        before = {r.request_id: r.num_tokens for r in engine.scheduler.running}
        for out in engine.step():
            got[out.request_id] = out
        accepted += sum(max(r.num_tokens - before.get(r.request_id, r.num_tokens) - 1, 0)
                        for r in engine.scheduler.running)
    assert proposed > 0 and 0 < accepted < proposed
    for i, o in enumerate(ref):
        spec_out = got[f"s{i}"].outputs[0]
        assert spec_out.token_ids == o.outputs[0].token_ids
        for a, b in zip(spec_out.logprobs, o.outputs[0].logprobs):
            t = next(iter(b))
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_two_ranks_receive_the_batch_by_broadcast(path):
    """The multiprocess executor's transport at world size 2: rank 0 gets each call over its pipe and
    broadcasts it (gloo) to rank 1; both run it, rank 0 answers. Each rank holds the whole model here,
    since tensor parallelism is a later issue, so both must agree with the in-process worker."""
    batches = record_batches(path)[:6]
    local = UniProcExecutor(config(path))
    expected = replay(local, batches)
    local.shutdown()
    ex = MultiprocExecutor(config(path, "mp"), world_size=2)
    try:
        assert_same(expected, replay(ex, batches))
        assert ex.collective_rpc("ping") == "pong"
    finally:
        ex.shutdown()
    assert all(p.exitcode == 0 for p in ex.procs)  # both ranks left the loop on the broadcast shutdown


def test_malloc_tuning_is_a_switch(monkeypatch):
    from tokenmill.platform import tune_malloc

    monkeypatch.setenv("TOKENMILL_MALLOC_TUNING", "0")
    assert tune_malloc() is False
    monkeypatch.delenv("TOKENMILL_MALLOC_TUNING")
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert tune_malloc() is True  # every threshold accepted (mmap's is within glibc's 32 MiB limit)
