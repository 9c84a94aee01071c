"""--quantized-batch-dtype bfloat16 (csrc/gguf_linear.cpp): from 32 rows of x, panels of a GGUF weight's rows are
dequantized into bf16 and multiplied by bf16 GEMMs. The kernel must equal torch's own bf16 product of the same
rounded operands (to the last bit of the rounding at real sizes), stay within bf16's error of the exact product, leave fewer rows on the float path bit for bit, and an
engine with the switch must give prompts the bf16 path and short prompts / decode their float32 tokens."""
from __future__ import annotations

import math

import gguf
import pytest
import torch
import torch.nn.functional as F

from gguf_tiny import smollm2_layout, write_gguf
from test_gguf_blocks import KERNEL_TYPES, needs_native, random_blocks, two_threads
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.layers.quantization import get_quantization_config
from tokenmill.layers.quantization import gguf as gq

T = gguf.GGMLQuantizationType
MIN_ROWS = 32  # BF16_MIN_ROWS in csrc/gguf_linear.cpp


def _dequantized(blocks, qtype, K: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(blocks.shape[0], K))


@needs_native
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_bf16_batches_equal_torch_bf16_product(qtype):
    """File-order blocks and (Q4_0 / Q4_1 / Q8_0) the kernels' split and interleaved rows (dequantized 16 rows at a
    time, transposed); odd row counts (interleaved: whole groups of 16); with a bias."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    K = 3 * block if block == 256 else 7 * block
    g = torch.Generator().manual_seed(2)
    for N in (45, 48):
        blocks = random_blocks(qtype, N, K, seed=3)
        w = _dequantized(blocks, qtype, K)
        layouts = [(torch.from_numpy(blocks), int(qtype))]
        if qtype in gq.SPLIT_BASES:
            split = gq.split_rows(torch.from_numpy(blocks).clone(), int(qtype))
            layouts.append((split, int(qtype) + gq.SPLIT))
            if gq.interleaves_rows(int(qtype), N):
                layouts.append((gq.interleave_rows(split, int(qtype)), int(qtype) + gq.R16))
        _check_bf16_product(qtype, K, N, w, layouts, g)


def _check_bf16_product(qtype, K, N, w, layouts, g):
    bias = torch.randn(N, generator=g)
    with two_threads():
        for M in (MIN_ROWS, 77):
            x = torch.randn(M, K, generator=g)
            want = F.linear(x.bfloat16(), w.bfloat16()).float()  # the same rounded operands, torch's own GEMM
            exact = x.double() @ w.double().T
            for wt, qt in layouts:
                y = torch.ops.tokenmill.gguf_linear(x, wt, qt, K, None, False, True)
                assert y.dtype == torch.float32 and y.shape == (M, N)
                torch.testing.assert_close(y, want, rtol=0, atol=0, msg=lambda m: f"{qtype.name} {qt} M={M}: {m}")
                # bf16 keeps 8 bits of mantissa: operands and result each off by at most 2^-9 relative
                err = (y.double() - exact).abs().max().item()
                assert err <= 3 * 2 ** -9 * (x.abs().double() @ w.abs().double().T).max().item()
                yb = torch.ops.tokenmill.gguf_linear(x, wt, qt, K, bias, False, True)
                torch.testing.assert_close(yb, want + bias, rtol=0, atol=1e-6 * want.abs().max().item())


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_fewer_rows_stay_on_the_float_path_bit_for_bit(qtype):
    K, N = 2 * 256, 40
    blocks = torch.from_numpy(random_blocks(qtype, N, K, seed=4))
    g = torch.Generator().manual_seed(5)
    with two_threads():
        for M in (1, 2, 8, MIN_ROWS - 1):
            x = torch.randn(M, K, generator=g)
            for x8 in (False, True):
                a = torch.ops.tokenmill.gguf_linear(x, blocks, int(qtype), K, None, x8, False)
                b = torch.ops.tokenmill.gguf_linear(x, blocks, int(qtype), K, None, x8, True)
                assert torch.equal(a, b), (qtype.name, M, x8)


@needs_native
def test_bf16_batches_at_a_real_size():
    """A 1.7B model's MLP shape: many panels of weight rows over two threads. Each output is a bf16 rounding of
    its float32 dot product, so against torch's one GEMM it may differ by the rounding's last bit and the float32
    noise of another summation order, no more."""
    K, N, M = 2048, 8192, 64
    blocks = random_blocks(T.Q4_0, N, K, seed=6)
    w = _dequantized(blocks, T.Q4_0, K)
    split = gq.split_rows(torch.from_numpy(blocks).clone(), int(T.Q4_0))
    layouts = [(split, int(T.Q4_0) + gq.SPLIT)]
    if gq.interleaves_rows(int(T.Q4_0), N):
        layouts.append((gq.interleave_rows(split, int(T.Q4_0)), int(T.Q4_0) + gq.R16))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(7))
    want = F.linear(x.bfloat16(), w.bfloat16()).float()
    for wt, qt in layouts:
        _check_real_size(x, w, wt, qt, K, want)


def _check_real_size(x, w, wt, qt, K, want):
    with two_threads():
        big = torch.ops.tokenmill.gguf_linear(x, wt, qt, K, None, False, True)
        again = torch.ops.tokenmill.gguf_linear(x, wt, qt, K, None, False, True)
    assert torch.equal(big, again)  # deterministic
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)  # bf16's last bit at each value
    # plus float32 summation noise where terms cancel (the GEMMs accumulate in float32 in different orders)
    noise = 1e-5 * (x.abs() @ w.abs().T)
    assert ((big - want).abs() <= ulp + noise).all()
    rel = ((big.double() - x.double() @ w.double().T).norm() / big.double().norm()).item()
    assert 0 < rel < 2 ** -7, rel  # rounded, not exact; within bf16's precision


def test_unknown_batch_dtype_is_refused():
    with pytest.raises(ValueError, match="quantized batch dtype 'float16'.*float32, bfloat16"):
        get_quantization_config("gguf", batch_dtype="float16")
    assert get_quantization_config("gguf", batch_dtype="bfloat16").bf16_batches


def test_cli_flag():
    from tokenmill.engine_args import EngineArgs

    args = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
        ["m.gguf", "--quantized-batch-dtype", "bfloat16"])
    assert EngineArgs.from_cli_args(args).create_engine_config().model.quantized_batch_dtype == "bfloat16"


LONG = list(range(3, 3 + 2 * MIN_ROWS + 5))  # one prefill of 69 rows: the bf16 GEMM
SHORT = [[5, 17, 33, 101], [200, 201, 7, 9, 11, 300, 2, 45]]  # under 32 rows: float32 throughout


def _llm(path, folder, **kw) -> LLM:
    return LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64, **kw)


@needs_native
def test_engine_prompts_in_bf16_short_prompts_and_decode_unchanged(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=True)
    path = write_gguf(folder, tmp_path / "m.gguf", types=smollm2_layout)
    greedy = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = _llm(path, folder, quantized_batch_dtype=dtype)
        gate_up = llm.engine.model.layers[0].mlp.gate_up_proj.quant_method
        assert gate_up.bf16_batches == (dtype == "bfloat16")
        short = [o.outputs[0].token_ids for o in llm.generate(SHORT, greedy, use_tqdm=False)]
        prompt = llm.generate([LONG], scored, use_tqdm=False)[0].prompt_logprobs[1:]
        runs[dtype] = short, [next(iter(d.values())).logprob for d in prompt]
        llm.close()
    assert runs["bfloat16"][0] == runs["float32"][0]  # one row at a time, and short prompts: float32 bit for bit
    diff = max(abs(a - b) for a, b in zip(runs["bfloat16"][1], runs["float32"][1]))
    assert 0 < diff < 0.05, diff  # the long prompt ran in bf16: close, not equal


def test_a_cpu_without_native_bf16_is_warned(tmp_path, monkeypatch, caplog):
    """The switch is opt-in; on a CPU that would emulate bf16 (AVX2 only) the start-up log says it is slower."""
    import logging

    from tokenmill import platform

    folder = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=True)
    path = write_gguf(folder, tmp_path / "m.gguf", types=smollm2_layout)
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with caplog.at_level(logging.WARNING, logger="tokenmill.executor.worker"):
        _llm(path, folder, quantized_batch_dtype="bfloat16").close()
    assert any("neither AVX-512 BF16 nor AMX-BF16" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx2", "fma", "amx_bf16"}))
    with caplog.at_level(logging.WARNING, logger="tokenmill.executor.worker"):
        _llm(path, folder, quantized_batch_dtype="bfloat16").close()
    assert not any("AMX-BF16" in r.getMessage() for r in caplog.records)
