"""Memory profiling before the GPU KV pool is sized (issue 31, executor/profile_steps.py): the dummy steps reach
for every buffer a real step can (the most tokens over the most sampled requests, the most logprobs and prompt
logprobs, k drafts verified per request under a grammar bitmask); they run through a real runner here and leave
it as they found it; the CUDA sizing arithmetic is checked with torch.cuda's memory calls stood in for."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_speculative import GREEDY, PROMPTS
from tiny import make_tiny_model
from tokenmill import LLM
from tokenmill.executor.profile_steps import MAX_LOGPROBS, profile_steps


def test_the_steps_fill_the_token_budget_with_every_request_sampled():
    steps, blocks = profile_steps(max_tokens=100, max_seqs=8, max_model_len=256, block_size=16, vocab_size=384,
                                  spec_k=3)
    prefill, verify, finish = steps
    assert prefill.num_tokens == 100 and len(prefill) == 8 and prefill.num_sample_rows == [1] * 8
    assert all(r.params.logprobs == MAX_LOGPROBS and r.params.prompt_logprobs == MAX_LOGPROBS
               for r in prefill.new_requests)
    assert set(prefill.prompt_logprob_ranges) == set(prefill.req_ids)
    assert verify.num_sample_rows == [4] * 8 and all(len(d) == 3 for d in verify.spec_token_ids.values())
    assert verify.grammar_bitmask.shape == (32, 12) and (verify.grammar_bitmask == -1).all()
    used = sorted(b for r in prefill.new_requests for b in r.block_ids)
    assert used == list(range(blocks))  # every request's own blocks, room for its drafts
    assert all(len(r.block_ids) * 16 >= len(r.token_ids) + 4 for r in prefill.new_requests)
    assert finish.finished_req_ids == prefill.req_ids
    # fewer tokens than requests: one token each; a single long prompt stays within max_model_len
    few, _ = profile_steps(max_tokens=5, max_seqs=8, max_model_len=64, block_size=16, vocab_size=384)
    assert len(few[0]) == 5 and len(few) == 2
    one, _ = profile_steps(max_tokens=500, max_seqs=1, max_model_len=64, block_size=16, vocab_size=384)
    assert one[0].num_tokens == 62


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=1)


def test_the_steps_run_through_a_runner_and_leave_it_clean(target):
    # (no prefix cache: the steps overwrite blocks the cache would otherwise offer again; in the worker they run on
    # a throw-away pool before the real one exists)
    llm = LLM(str(target), num_gpu_blocks_override=64, block_size=16, max_model_len=256, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    runner = llm.engine.core.executor.worker.runner
    steps, blocks = profile_steps(96, 8, 256, 16, runner.vocab_size, spec_k=3)
    assert blocks <= 64
    prefill_out = runner.execute_model(steps[0])
    assert len(prefill_out.req_ids) == 8
    assert all(len(lp) == 1 and len(lp[0][2]) == MAX_LOGPROBS for lp in prefill_out.logprobs.values())
    assert len(prefill_out.prompt_logprobs) == 8
    verify_out = runner.execute_model(steps[1])
    assert all(1 <= len(t) <= 4 for t in verify_out.sampled_token_ids) and len(verify_out.req_ids) == 8
    runner.execute_model(steps[2])
    assert not any(r.startswith("profile-") for r in runner.input_batch.requests)  # every profiling request forgotten
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert after == before


def test_cuda_sizing_counts_the_profiled_peak(target, monkeypatch):
    """The worker's CUDA path on a CPU worker with torch.cuda's memory calls stood in for: the profiling steps
    run (the most requests, drafts verified), and the pool gets utilization x total - peak - others."""
    llm = LLM(str(target), num_gpu_blocks_override=64, block_size=16, max_model_len=256, max_num_seqs=6,
              max_num_batched_tokens=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    worker = llm.engine.core.executor.worker
    runner = worker.runner
    ran = []
    execute = runner.execute_model
    monkeypatch.setattr(runner, "execute_model", lambda b: ran.append(b) or execute(b))
    GiB = 2**30
    for name, fn in {"empty_cache": lambda: None, "reset_peak_memory_stats": lambda d=None: None,
                     "synchronize": lambda d=None: None, "max_memory_allocated": lambda d=None: 3 * GiB,
                     "mem_get_info": lambda d=None: (70 * GiB, 80 * GiB), "memory_reserved": lambda d=None: 4 * GiB}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    per_block = runner.bytes_per_block
    n = worker._profile_cuda_blocks(runner.kv_dtype, per_block)
    assert [len(b) for b in ran] == [6, 6, 0] and ran[1].spec_token_ids
    steps_blocks = sum(len(r.block_ids) for r in ran[0].new_requests)
    peak = 3 * GiB - steps_blocks * per_block
    others = 80 * GiB - 70 * GiB - 4 * GiB
    assert n == (int(80 * GiB * llm.engine.config.cache.gpu_memory_utilization) - peak - others) // per_block
    assert all(a.k_cache is None for a in runner.attn_layers)  # the throw-away pool is gone
    runner.allocate_kv_cache(64, runner.kv_dtype)
    assert np.isfinite(n)


def test_cuda_sizing_sets_aside_what_the_decode_graphs_hold(target, monkeypatch):
    """With CUDA graphs planned, the graphs are captured once on the profiling pool and what they reserve (their
    private pool) comes off the KV budget, with the pad block; then they are released (captured again later)."""
    llm = LLM(str(target), num_gpu_blocks_override=64, block_size=16, max_model_len=256, max_num_seqs=6,
              max_num_batched_tokens=64)
    worker = llm.engine.core.executor.worker
    runner = worker.runner
    GiB = 2**30
    reserved = [4 * GiB]
    captured = []

    def capture(max_num_seqs, max_blocks, query_lens):  # stands for DecodeGraphs.capture's reservations
        captured.append((max_num_seqs, max_blocks, query_lens))
        reserved[0] += GiB
        runner.graphs = object()

    def empty_cache():  # what is released goes back to the device: the graphs' GiB once they are dropped
        if runner.graphs is None:
            reserved[0] = 4 * GiB

    for name, fn in {"empty_cache": empty_cache, "reset_peak_memory_stats": lambda d=None: None,
                     "synchronize": lambda d=None: None, "max_memory_allocated": lambda d=None: 3 * GiB,
                     "mem_get_info": lambda d=None: (70 * GiB, 80 * GiB),
                     "memory_reserved": lambda d=None: reserved[0]}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(runner, "capture_graphs", capture)
    per_block = runner.bytes_per_block
    plain = worker._profile_cuda_blocks(runner.kv_dtype, per_block)
    assert not captured
    monkeypatch.setattr(runner, "graph_mode", "cuda")
    with_graphs = worker._profile_cuda_blocks(runner.kv_dtype, per_block)
    assert captured == [(6, 256 // 16, (1,))] and runner.graphs is None
    _, blocks = profile_steps(64, 6, 256, 16, runner.vocab_size)
    left = int(80 * GiB * llm.engine.config.cache.gpu_memory_utilization) - (3 * GiB - blocks * per_block) \
        - (80 - 70 - 4) * GiB  # utilization x total - peak - others
    assert plain == left // per_block
    assert with_graphs == (left - GiB - per_block) // per_block  # the graphs' GiB and their pad block
    runner.graph_mode = None
    runner.allocate_kv_cache(64, runner.kv_dtype)
