"""The Triton paged-attention backend (issue 31, `triton_paged`), run on this CPU under TRITON_INTERPRET=1: the
conformance suite's scenarios against float64 dense attention (ragged prompts, chunks, decodes, prefix hits,
speculative rows, sliding windows, GQA/MQA, bfloat16, page sizes 1 and 16, a soft cap, a NaN-filled pool),
quantized caches equal to torch_sdpa's over the same bytes, tree rows, and a tiny model end to end whose greedy
output and logprobs equal transformers'. (Small shapes: the interpreter runs each program in numpy. The full
conformance matrix of test_attention_backends.py runs the CPU backends; this file runs its scenarios for Triton.)"""
from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from test_attention_backends import CPU, Harness, dense_reference, run_scenario
from test_parity import check_against_oracle, hf_greedy, prompts_for
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import BatchLayout, available_backends, get_attention_backend, kv_quant

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
BACKEND = "triton_paged"


def test_selectable_on_the_cpu_under_the_interpreter_only(monkeypatch):
    assert os.environ.get("TRITON_INTERPRET") == "1"  # (tests/conftest.py, before Triton is first imported)
    assert BACKEND in available_backends(CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert BACKEND not in available_backends(CPU)
    with pytest.raises(ValueError, match="triton_paged"):
        get_attention_backend(BACKEND, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hk", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_matches_dense_attention(dtype, H, Hk):
    rng = random.Random(H * 10 + Hk)
    h = Harness.make(BACKEND, dtype, H, Hk, 64, windows=[None, rng.randint(3, 20)], table_dtype=torch.int32)
    run_scenario(h, rng)


@pytest.mark.parametrize("block_size", [1, 16])
def test_other_block_sizes_and_a_wide_head(block_size):
    h = Harness.make(BACKEND, torch.float32, 2, 1, 80, windows=[None, 5], block_size=block_size, num_blocks=800)
    run_scenario(h, random.Random(block_size))


def test_logits_soft_cap():
    run_scenario(Harness.make(BACKEND, torch.float32, 4, 2, 64, windows=[None, 7], soft_cap=0.5), random.Random(3))


@pytest.mark.parametrize("kv_dtype", [torch.int8, kv_quant.FP8], ids=["int8", "fp8"])
def test_quantized_caches_equal_torch_sdpa_over_the_same_bytes(kv_dtype):
    """int8 (per-slot scales) and fp8 e4m3 (bits decoded in the kernel): the same writes, the same output as the
    torch reference backend up to float32 summation order."""
    torch.manual_seed(0)
    H, Hk, D, bs = 4, 2, 64, 8
    outs, caches = [], []
    for name in (BACKEND, "torch_sdpa"):
        b = get_attention_backend(name, CPU)(bs, CPU)
        layer = Attention(H, Hk, D, D**-0.5)
        b.allocate_kv_cache([layer], 16, kv_dtype)
        b.mark_initialized(torch.arange(16))
        for c in kv_quant.layer_caches(layer):
            c.zero_()
        layer.k_scale, layer.v_scale = 0.5, 0.25
        g = torch.Generator().manual_seed(1)
        got = []
        for start, n in ((0, 19), (19, 1), (20, 3)):  # a prompt, a decode, a chunk
            layout = BatchLayout(
                query_start=torch.tensor([0]), query_len=torch.tensor([n]), kv_len=torch.tensor([start + n]),
                block_table=torch.tensor([[3, 9, 1, 12]], dtype=torch.int32),
                slot_mapping=torch.tensor([[3, 9, 1, 12][p // bs] * bs + p % bs for p in range(start, start + n)]),
                num_tokens=n, max_query_len=n, max_kv_len=start + n)
            q, k, v = (torch.randn(n, x, D, generator=g) for x in (H, Hk, Hk))
            got.append(layer(q, k, v, b.build_metadata(layout)))
        outs.append(torch.cat(got))
        caches.append(kv_quant.layer_caches(layer))
    for a, c in zip(*caches):
        assert torch.equal(a, c)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_float32_queries_ask_for_exact_dots(monkeypatch):
    """tl.dot's default on a GPU is tf32 (~1e-3 off): on an H200 that flipped a float32 model's greedy tokens.
    The launch asks for IEEE products for float32 queries (unless torch allows tf32 on CUDA), never for 16-bit."""
    from tokenmill.layers.attention_backends import triton_kernel as tk

    seen = []

    class Kernel:  # stands in for the JIT function: records the launch's constexprs
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw["IEEE_F32"])

    monkeypatch.setattr(tk, "paged_attention_kernel", Kernel())
    i32 = torch.zeros(1, dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        q, cache = torch.zeros(1, 2, 16, dtype=dtype), torch.zeros(1, 16, 1, 16, dtype=dtype)
        tk.launch(q, cache, cache, None, None, q, i32.view(1, 1), i32, i32, i32, i32 + 1, i32 + 1, 0.25, None, 1.0,
                  1.0, None, tk.FLOAT, 16, 32)
    assert seen == [True, False]


def test_tree_rows_see_their_ancestors_only():
    from test_tree_attention import test_tree_rows_see_their_ancestors_only as check
    from tokenmill.layers.attention_backends.triton_paged import TritonPagedBackend

    check(TritonPagedBackend, None)


def test_an_empty_step_and_a_fresh_pool_of_nan_give_finite_rows():
    b = get_attention_backend(BACKEND, CPU)(4, CPU)
    layer = Attention(2, 1, 64, 0.125)
    b.allocate_kv_cache([layer], 8, torch.float32)
    layer.k_cache.fill_(float("nan"))
    layer.v_cache.fill_(float("nan"))
    layout = BatchLayout(query_start=torch.tensor([0]), query_len=torch.tensor([3]), kv_len=torch.tensor([3]),
                         block_table=torch.tensor([[5]]), slot_mapping=torch.tensor([20, 21, 22]), num_tokens=3,
                         max_query_len=3, max_kv_len=3)
    q, k, v = torch.randn(3, 2, 64, dtype=torch.float64), torch.randn(3, 1, 64, dtype=torch.float64), \
        torch.randn(3, 1, 64, dtype=torch.float64)
    out = layer(q.float(), k.float(), v.float(), b.build_metadata(layout))
    torch.testing.assert_close(out.double(), dense_reference(q, k.float().double(), v.float().double(), 0.125, None),
                               atol=1e-4, rtol=1e-4)


def test_a_tiny_model_end_to_end_equals_transformers(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama")
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, block_size=16, attention_backend=BACKEND,
              max_num_batched_tokens=32)
    assert type(llm.engine.core.executor.worker.runner.backend).__name__ == "TritonPagedBackend"
    prompts = prompts_for(llm.engine.vocab_size)[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3), use_tqdm=False)
    check_against_oracle(outs, hf_greedy(path, prompts), "triton_paged")
