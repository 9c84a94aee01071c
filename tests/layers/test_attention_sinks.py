"""Attention sinks (gpt-oss: a learned logit per head that joins each softmax's denominator, its weight dropped) in
every CPU attention backend: the conformance scenarios of test_attention_backends.py (prompts, chunks, prefix hits,
decodes, speculative rows, a sliding window next to a full layer) against float64 softmax-with-sink; long decodes
that cpu_paged splits into partitions and merges; quantized caches equal to torch_sdpa's over the same bytes; context
parallelism's merge of the ranks' partial attention adding each sink once; a backend without sinks refusing the
layers at allocation; triton_paged under the interpreter."""
from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

from test_attention_backends import BACKENDS, CPU, Harness, run_scenario
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import BatchLayout, get_attention_backend, kv_quant
from tokenmill.layers.attention_backends.context_parallel import ContextParallelBackend
from tokenmill.layers.attention_backends.torch_sdpa import TorchSDPABackend

# Sinks below, near and well above the scores' scale: the sink takes from nothing up to most of the weight.
SINKS = torch.tensor([-3.0, 0.0, 1.5, 6.0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hk", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_sinks_match_float64_reference(backend, dtype, H, Hk):
    rng = random.Random(H * 10 + Hk)
    h = Harness.make(backend, dtype, H, Hk, 64, windows=[None, rng.randint(3, 20)], sinks=SINKS)
    run_scenario(h, rng)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_with_soft_cap_and_block_size_one(backend):
    h = Harness.make(backend, torch.float32, 4, 2, 64, windows=[None, 5], soft_cap=0.5, block_size=1,
                     num_blocks=800, sinks=SINKS)
    run_scenario(h, random.Random(5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_on_long_decodes(backend):
    """Contexts of ~700 keys: cpu_paged splits each decode into partitions of 256+ keys and merges them, where the
    sink must be added once."""
    h = Harness.make(backend, torch.float32, 4, 2, 64, windows=[None, 300], block_size=16, num_blocks=200,
                     sinks=SINKS)
    a, b = h.new_seq(700 + 3), h.new_seq(650 + 3)
    h.step([(a, 700), (b, 650)])
    for _ in range(3):
        h.step([(a, 1), (b, 1)])


@pytest.mark.parametrize("kv_dtype", [torch.int8, kv_quant.FP8], ids=["int8", "fp8"])
def test_quantized_caches_with_sinks_equal_torch_sdpa(kv_dtype):
    """cpu_paged's quantized caches with sinks: the torch reference backend's output over the same bytes."""
    if "cpu_paged" not in BACKENDS:
        pytest.skip("no native kernels")
    torch.manual_seed(0)
    H, Hk, D, bs, n = 4, 2, 64, 8, 40
    q, k, v = torch.randn(n, H, D), torch.randn(n, Hk, D), torch.randn(n, Hk, D)
    layout = BatchLayout(query_start=torch.tensor([0, 30]), query_len=torch.tensor([30, 10]),
                         kv_len=torch.tensor([30, 10]), block_table=torch.tensor([[3, 1, 4, 0], [2, 5, 0, 0]]),
                         slot_mapping=torch.cat([torch.tensor([3, 1, 4, 0]).repeat_interleave(bs)[:30] * bs
                                                 + torch.arange(30) % bs,
                                                 torch.tensor([2, 5]).repeat_interleave(bs)[:10] * bs
                                                 + torch.arange(10) % bs]),
                         num_tokens=n, max_query_len=30, max_kv_len=30)
    outs = []
    for name in ("torch_sdpa", "cpu_paged"):
        backend = get_attention_backend(name, CPU)(bs, CPU)
        layer = Attention(H, Hk, D, D**-0.5, 12, sinks=True)
        layer.sinks.data.copy_(SINKS)
        backend.allocate_kv_cache([layer], 8, kv_dtype)
        outs.append(layer(q, k, v, backend.build_metadata(layout)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


class NoSinksBackend(TorchSDPABackend):
    """A backend that does not add sinks (not registered): what one must do with such layers."""

    name = "no_sinks_test"
    supports_sinks = False


def test_a_backend_without_sinks_refuses_them():
    layers = [Attention(4, 2, 64, 0.125, sinks=True)]
    with pytest.raises(ValueError, match="'no_sinks_test' has no attention sinks"):
        NoSinksBackend(8, CPU).allocate_kv_cache(layers, 4, torch.float32)
    NoSinksBackend(8, CPU).allocate_kv_cache([Attention(4, 2, 64, 0.125)], 4, torch.float32)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("ranks", [2, 3])
def test_context_parallel_merge_adds_each_sink_once(monkeypatch, ranks, window):
    """Each rank attends its own blocks; the merge of the ranks' (out, lse) adds a head's sink once: the result is
    the whole attention with sinks (torch_sdpa's, itself checked against float64 above)."""
    from tokenmill.executor.input_batch import pack_layout
    from tokenmill.layers import collectives

    torch.manual_seed(0)
    H, Hk, D, bs, pool = 4, 2, 8, 4, 24
    tables = [[3, 7, 1, 10], [2, 5, 8, 11], [4, 9]]  # a chunk after 9 cached tokens, a decode, a fresh prompt
    layout, _ = pack_layout(np.array([9, 13, 0]), np.array([5, 1, 7]), tables, bs)
    hist_k, hist_v = torch.randn(pool, bs, Hk, D), torch.randn(pool, bs, Hk, D)
    q, k, v = torch.randn(13, H, D), torch.randn(13, Hk, D), torch.randn(13, Hk, D)

    def attention(backend, num_blocks, owned):
        layer = Attention(H, Hk, D, D ** -0.5, sliding_window=window, sinks=True)
        layer.sinks.data.copy_(SINKS)
        backend.allocate_kv_cache([layer], num_blocks, torch.float32)
        for b in owned:
            layer.k_cache[owned[b]], layer.v_cache[owned[b]] = hist_k[b], hist_v[b]
        backend.mark_initialized(torch.arange(num_blocks))
        return backend.forward(layer, q, k, v, backend.build_metadata(layout))

    want = attention(TorchSDPABackend(bs, "cpu"), pool, {b: b for b in range(pool)})
    shares = {r: {b: b // ranks for b in range(pool) if b % ranks == r} for r in range(ranks)}
    partials = []
    monkeypatch.setattr(collectives, "all_gather_stack", lambda ts: partials.append(ts) or [t.unsqueeze(0) for t in ts])
    for r in range(ranks):  # each rank's partial (out, lse)
        attention(ContextParallelBackend(bs, "cpu", r, ranks), pool // ranks, shares[r])
    gathered = [torch.stack([p[i] for p in partials]) for i in range(2)]
    monkeypatch.setattr(collectives, "all_gather_stack", lambda ts: gathered)
    for r in range(ranks):  # every rank merges the same
        got = attention(ContextParallelBackend(bs, "cpu", r, ranks), pool // ranks, shares[r])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sinks_match_float64_reference(dtype):
    """triton_paged under TRITON_INTERPRET=1 (tests/conftest.py): the kernel adds each head's sink where it
    normalises a row."""
    h = Harness.make("triton_paged", dtype, 4, 2, 64, windows=[None, 7], sinks=SINKS, table_dtype=torch.int32)
    run_scenario(h, random.Random(7))
