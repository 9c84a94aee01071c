"""Attention sinks (gpt-oss: a learned logit per head that joins each softmax's denominator, its weight dropped) in
every CPU attention backend: the conformance scenarios of test_attention_backends.py (prompts, chunks, prefix hits,
decodes, speculative rows, a sliding window next to a full layer) against float64 softmax-with-sink; long decodes
that cpu_paged splits into partitions and merges; quantized caches equal to torch_sdpa's over the same bytes; and a
backend without sinks refusing the layers at allocation; triton_paged under the interpreter."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from test_attention_backends import BACKENDS, CPU, Harness, run_scenario
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import BatchLayout, get_attention_backend, kv_quant
from tokenmill.layers.attention_backends.context_parallel import ContextParallelBackend

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


def test_a_backend_without_sinks_refuses_them():
    layers = [Attention(4, 2, 64, 0.125, sinks=True)]
    with pytest.raises(ValueError, match="no attention sinks"):
        ContextParallelBackend(8, CPU, 0, 1).allocate_kv_cache(layers, 4, torch.float32)
    ContextParallelBackend(8, CPU, 0, 1).allocate_kv_cache([Attention(4, 2, 64, 0.125)], 4, torch.float32)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_sinks_match_float64_reference(dtype):
    """triton_paged under TRITON_INTERPRET=1 (tests/conftest.py): the kernel adds each head's sink where it
    normalises a row."""
    h = Harness.make("triton_paged", dtype, 4, 2, 64, windows=[None, 7], sinks=SINKS, table_dtype=torch.int32)
    run_scenario(h, random.Random(7))
