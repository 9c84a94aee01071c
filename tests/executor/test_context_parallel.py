"""Context parallelism (issue 29, layers/attention_backends/context_parallel.py): every sequence's K/V split over
ranks by block, each rank's partial attention merged by log-sum-exp; with prefill context parallelism the step's
tokens split over the same ranks too.

The merge is exact: the ranks' partial results over their own blocks, merged, equal the whole attention (plain
and chunked queries, GQA, a sliding window, a soft cap), checked in one process; so are the token shares. End to
end on two gloo ranks, decode and prefill context parallelism alike, greedy output equals one rank's (plain,
chunked, preempted, prefix hits) for a Llama and transformers' for a Gemma 3 with KV cache groups, and a pool per
rank of half a context runs a full-length request; on four ranks, tensor parallelism 2 x context parallelism 2
equals one rank. Combinations not built are refused with their reason."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_parity import check_against_oracle, hf_greedy
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.executor.input_batch import pack_layout
from tokenmill.layers import collectives
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends.context_parallel import ContextParallelBackend, TokenSplit
from tokenmill.layers.attention_backends.torch_sdpa import TorchSDPABackend

SP = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=3)


@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("ranks", [2, 3])
def test_partial_attention_merges_to_the_whole(monkeypatch, ranks, window, cap):
    torch.manual_seed(0)
    H, Hk, D, bs, pool = 4, 2, 8, 4, 24
    # a prompt chunk of 5 after 9 cached tokens, a decode at position 13, a 7-token prompt from the start
    tables = [[3, 7, 1, 10], [2, 5, 8, 11], [4, 9]]
    layout, _ = pack_layout(np.array([9, 13, 0]), np.array([5, 1, 7]), tables, bs)
    T = 13
    hist_k, hist_v = torch.randn(pool, bs, Hk, D), torch.randn(pool, bs, Hk, D)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hk, D), torch.randn(T, Hk, D)

    def attention(backend, num_blocks, owned):
        layer = Attention(H, Hk, D, D ** -0.5, sliding_window=window, logits_soft_cap=cap)
        backend.allocate_kv_cache([layer], num_blocks, torch.float32)
        for b in owned:
            layer.k_cache[owned[b]], layer.v_cache[owned[b]] = hist_k[b], hist_v[b]
        backend.mark_initialized(torch.arange(num_blocks))
        return backend.forward(layer, q, k, v, backend.build_metadata(layout))

    want = attention(TorchSDPABackend(bs, "cpu"), pool, {b: b for b in range(pool)})
    partials = []
    monkeypatch.setattr(collectives, "all_gather_stack", lambda ts: partials.append(ts) or [t.unsqueeze(0) for t in ts])
    for r in range(ranks):
        attention(ContextParallelBackend(bs, "cpu", r, ranks), pool // ranks,
                  {b: b // ranks for b in range(pool) if b % ranks == r})
    outs, lses = torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials])
    assert torch.isinf(lses).any()  # some rows have no key on some rank
    w = torch.exp(lses - lses.max(0).values)
    got = (w.unsqueeze(-1) * outs).sum(0) / w.sum(0).unsqueeze(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def prompts(n: int = 4):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 380, (k,), generator=g).tolist() for k in [5, 40, 61, 93][:n]]


def same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for t in ex:
                assert abs(ex[t].logprob - ey[t].logprob) < 1e-4


@pytest.mark.parametrize("T,ranks", [(1, 2), (7, 2), (8, 2), (10, 3)])
def test_token_shares_cover_the_step_once(monkeypatch, T, ranks):
    x = torch.arange(T * 2, dtype=torch.float32).view(T, 2)
    shares = [TokenSplit(r, ranks).local(x) for r in range(ranks)]
    assert len({s.shape for s in shares}) == 1  # equal shapes for the all-gathers
    monkeypatch.setattr(collectives, "all_gather_rows", lambda t: torch.cat(shares))
    torch.testing.assert_close(TokenSplit(0, ranks).gather(shares[0], T), x)


CP_MODES = ["decode_context_parallel_size", "prefill_context_parallel_size"]


@pytest.mark.parametrize("mode", CP_MODES)
def test_two_ranks_equal_one(tmp_path, mode):
    path = make_tiny_model(tmp_path / "llama", "llama")
    kw = dict(max_model_len=128, block_size=8)
    want = LLM(str(path), num_gpu_blocks_override=64, **kw).generate(prompts(), SP, use_tqdm=False)
    # 8 blocks per rank: half of one 128-token context; with one rank that pool is refused
    with pytest.raises(ValueError, match="fewer than one request"):
        LLM(str(path), num_gpu_blocks_override=8, **kw)
    llm = LLM(str(path), num_gpu_blocks_override=8, max_num_batched_tokens=32, **{mode: 2}, **kw)
    assert llm.engine.kv.num_blocks == 16
    assert llm.engine.core.info.attention_backend == "torch_sdpa_context_parallel"
    same(llm.generate(prompts(), SP, use_tqdm=False), want)  # chunks of 32; requests preempt each other
    assert llm.engine.scheduler.num_preemptions > 0
    roomy = LLM(str(path), num_gpu_blocks_override=32, **{mode: 2}, **kw)
    same(roomy.generate(prompts(), SP, use_tqdm=False), want)
    hits = roomy.engine.kv.stats.hits
    same(roomy.generate(prompts(), SP, use_tqdm=False), want)  # prefix hits on blocks of both ranks
    assert roomy.engine.kv.stats.hits > hits
    for engine in (llm.engine, roomy.engine):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("mode", CP_MODES)
def test_two_ranks_with_kv_cache_groups_equal_transformers(tmp_path, mode):
    path = make_tiny_model(tmp_path / "gemma3", "gemma3", num_hidden_layers=3,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    SPG = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32, logprobs=3)
    oracle = hf_greedy(path, prompts())
    llm = LLM(str(path), max_model_len=128, block_size=8, num_gpu_blocks_override=100, max_num_batched_tokens=32,
              **{mode: 2})
    assert llm.engine.kv.group_windows == (None, 24, 24)
    check_against_oracle(llm.generate(prompts(), SPG, use_tqdm=False), oracle, mode)
    assert llm.engine.kv.num_released > 0


def test_tensor_parallel_times_context_parallel_equals_one_rank(tmp_path):
    """Four gloo ranks: two tensor-parallel shards of the weights, each with two context-parallel ranks that split
    the tokens and the K/V (rank = tp_rank * 2 + cp_rank; the all-reduces run over equal cp_rank, the all-gathers
    over equal tp_rank)."""
    path = make_tiny_model(tmp_path / "llama", "llama")
    kw = dict(max_model_len=128, block_size=8)
    want = LLM(str(path), num_gpu_blocks_override=64, **kw).generate(prompts(), SP, use_tqdm=False)
    llm = LLM(str(path), num_gpu_blocks_override=8, tensor_parallel_size=2, prefill_context_parallel_size=2,
              max_num_batched_tokens=32, **kw)
    assert llm.engine.kv.num_blocks == 16
    same(llm.generate(prompts(), SP, use_tqdm=False), want)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("extra,why", [
    (dict(pipeline_parallel_size=2), "pipeline parallelism"),
    (dict(prefill_context_parallel_size=4), "give one size, or equal sizes"),
    (dict(prefill_context_parallel_size=2, enable_lora=True), "LoRA"),
    (dict(speculative_config={"method": "ngram"}), "speculative decoding"),
    (dict(kv_offload_bytes=1 << 20), "KV offloading"),
    (dict(kv_cache_dtype="int8"), "quantized KV cache"),
    (dict(attention_backend="cpu_paged"), "attention backend 'cpu_paged'"),
])
def test_combinations_not_built_are_refused(extra, why):
    from tokenmill.engine_args import EngineArgs

    with pytest.raises(ValueError, match=why):
        EngineArgs(decode_context_parallel_size=2, **extra).create_engine_config().validate()
