"""The fused elementwise kernels (csrc/fused_ops.cpp) equal their torch references, and a model run with
them gives the same greedy tokens as one run with TOKENMILL_FUSED_OPS off (the reference ops)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, native
from tokenmill.layers import fused

needs_native = pytest.mark.skipif(not (native.available() and hasattr(torch.ops.tokenmill, "add_rms_norm")),
                                  reason="tokenmill._C not built or without the fused ops")

SHAPES = [(1, 64), (3, 576), (17, 37), (40, 8)]  # 40 rows: several parallel work items; 37/8: vector tails


@needs_native
@pytest.mark.parametrize("T,D", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_and_add(T, D, offset):
    g = torch.Generator().manual_seed(T * D)
    x, h = torch.randn(T, D, generator=g) * 3, torch.randn(T, D, generator=g) * 3
    w = torch.randn(D, generator=g)
    ref = fused.rms_norm_ref(x, w, 1e-6, offset)
    torch.testing.assert_close(torch.ops.tokenmill.rms_norm(x, w, 1e-6, offset), ref, rtol=1e-5, atol=1e-5)
    s, out = torch.ops.tokenmill.add_rms_norm(x, h, w, 1e-6, offset)
    torch.testing.assert_close(s, x + h, rtol=0, atol=0)
    torch.testing.assert_close(out, fused.rms_norm_ref(x + h, w, 1e-6, offset), rtol=1e-5, atol=1e-5)
    # strided rows (a view into a wider tensor) read through their stride
    wide = torch.randn(T, D + 5, generator=g)
    torch.testing.assert_close(fused.rms_norm(wide[:, :D], w, 1e-6, offset),
                               fused.rms_norm_ref(wide[:, :D], w, 1e-6, offset), rtol=1e-5, atol=1e-5)


@needs_native
def test_rms_norm_per_head_3d():
    x = torch.randn(5, 4, 16)
    w = torch.randn(16)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6, 0.0), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("T,H,Hk,D", [(1, 9, 3, 64), (7, 4, 2, 16), (33, 2, 1, 10)])
def test_rotary_reads_qkv_views(T, H, Hk, D):
    g = torch.Generator().manual_seed(T)
    qkv = torch.randn(T, (H + 2 * Hk) * D, generator=g)
    q, k, _ = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, Hk, D)
    P = 50
    ang = torch.randn(P, D // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()
    pos = torch.randint(0, P, (T,), generator=g)
    got_q, got_k = torch.ops.tokenmill.rotary(q, k, pos, cos, sin)
    ref_q, ref_k = fused.rotary_ref(q, k, pos, cos, sin)
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-6)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tokenmill.rotary(q, k, torch.full((T,), P), cos, sin)


BF16 = dict(rtol=2 ** -7, atol=1e-3)  # one bf16 rounding of a float32 result (the kernels round once)


@needs_native
@pytest.mark.parametrize("T,D", SHAPES)
def test_bf16_rows_computed_in_float32_rounded_once(T, D):
    """bf16 rows: the float32 computation of the same bf16 inputs, rounded to bf16 once."""
    g = torch.Generator().manual_seed(7 * T + D)
    x, h = (torch.randn(T, D, generator=g) * 3).bfloat16(), (torch.randn(T, D, generator=g) * 3).bfloat16()
    w = torch.randn(D, generator=g).bfloat16()
    out = torch.ops.tokenmill.rms_norm(x, w, 1e-6, 1.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fused.rms_norm_ref(x.float(), w, 1e-6, 1.0).bfloat16(), **BF16)
    s, out = torch.ops.tokenmill.add_rms_norm(x, h, w, 1e-6, 0.0)
    assert torch.equal(s, x + h)  # torch's bf16 add: float32 sum rounded once, as the kernel
    torch.testing.assert_close(out, fused.rms_norm_ref(s.float(), w, 1e-6, 0.0).bfloat16(), **BF16)
    gu = (torch.randn(T, 2 * D, generator=g) * 4).bfloat16()
    gate, up = gu.float().chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.tokenmill.silu_and_mul(gu), (F.silu(gate) * up).bfloat16(), **BF16)
    torch.testing.assert_close(torch.ops.tokenmill.gelu_tanh_and_mul(gu),
                               (F.gelu(gate, approximate="tanh") * up).bfloat16(), **BF16)
    # The Python dispatch takes the kernels for bf16 too, and agrees with the bf16 torch reference.
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6, 0.0), **BF16)


@needs_native
@pytest.mark.parametrize("T,H,Hk,D", [(1, 9, 3, 64), (33, 2, 1, 10)])
def test_bf16_rotary(T, H, Hk, D):
    g = torch.Generator().manual_seed(T + 100)
    qkv = torch.randn(T, (H + 2 * Hk) * D, generator=g).bfloat16()
    q, k, _ = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, Hk, D)
    ang = torch.randn(40, D // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()
    pos = torch.randint(0, 40, (T,), generator=g)
    got_q, got_k = torch.ops.tokenmill.rotary(q, k, pos, cos, sin)
    ref_q, ref_k = fused.rotary_ref(q.float(), k.float(), pos, cos, sin)
    assert got_q.dtype == got_k.dtype == torch.bfloat16
    torch.testing.assert_close(got_q, ref_q.bfloat16(), **BF16)
    torch.testing.assert_close(got_k, ref_k.bfloat16(), **BF16)


@needs_native
@pytest.mark.parametrize("T,I", [(1, 1536), (2, 13), (9, 600)])
def test_act_and_mul(T, I):
    gu = torch.randn(T, 2 * I) * 4
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturated tails stay finite and exact
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.tokenmill.silu_and_mul(gu), F.silu(gate) * up, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(torch.ops.tokenmill.gelu_tanh_and_mul(gu), F.gelu(gate, approximate="tanh") * up,
                               rtol=2e-5, atol=2e-5)


def test_references_used_off_cpu_float32(monkeypatch):
    """fp16 inputs (and the switch turned off) take the torch path, with the same results."""
    x = torch.randn(3, 32, dtype=torch.float16)
    w = torch.randn(32)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6, 0.0))
    monkeypatch.setattr(fused, "ENABLED", False)
    x32 = torch.randn(3, 32)
    s, out = fused.add_rms_norm(x32, x32, w, 1e-6)
    torch.testing.assert_close(out, fused.rms_norm_ref(2 * x32, w, 1e-6, 0.0))


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_model_greedy_equal_with_and_without_fused_ops(tmp_path, monkeypatch, arch):
    path = make_tiny_model(tmp_path / arch, arch)
    prompts = ["the quick brown fox", "hello world, this is a longer prompt with more tokens in it"]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(fused, "ENABLED", on)
        llm = LLM(model=str(path), max_model_len=128)
        outs[on] = llm.generate(prompts, sp)
        del llm
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            tok = next(iter(la))
            assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4


@needs_native
def test_bf16_model_with_and_without_fused_ops(tmp_path, monkeypatch):
    """bf16: the kernels round once where the torch ops round after each op, so outputs agree within bf16
    rounding: the first token and its logprob, not necessarily every later greedy choice."""
    path = make_tiny_model(tmp_path / "llama", "llama")
    prompts = ["the quick brown fox", "hello world, this is a longer prompt with more tokens in it"]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(fused, "ENABLED", on)
        llm = LLM(model=str(path), max_model_len=128, dtype="bfloat16")
        outs[on] = llm.generate(prompts, sp)
        del llm
    for a, b in zip(outs[True], outs[False]):
        first = a.outputs[0].token_ids[0]
        assert first == b.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0][first].logprob - b.outputs[0].logprobs[0][first].logprob) < 0.05
