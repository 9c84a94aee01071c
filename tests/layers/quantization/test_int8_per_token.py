"""--activation-quantization int8_per_token: int8 weights (one scale per output row) times activations quantized
to int8 with one scale per row of x, multiplied in exact int32 by torch._int_mm (W8A8, vLLM's dynamic per-token).

- The product equals the float64 product of the quantized x with the dequantized weights.
- Integer sums are exact: a row's result is bit for bit the same alone or among any number of rows, so greedy
  output does not depend on the batch.
- A tiny model with the switch stays close to the same int8 model with float activations.
"""
from __future__ import annotations

import pytest
import torch

from compare import greedy_with_logprobs
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, native
from tokenmill.engine_args import EngineArgs
from tokenmill.layers.quantization import get_quantization_config
from tokenmill.layers.quantization.weight_only import (int8_per_token_matmul, quantize_int8,
                                                       quantize_rows_int8)

ROWS = (1, 2, 3, 5, 8, 16, 17, 33, 65)


def test_matmul_equals_quantized_reference_and_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    for N, K in ((17, 40), (257, 96), (64, 1536)):
        q, s = quantize_int8(torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3)
        bias = torch.randn(N, generator=g)
        x = torch.randn(max(ROWS), K, generator=g) * torch.rand(max(ROWS), 1, generator=g) * 5
        x[2] = 0.0  # an all-zero row: scale 0, output = bias
        alone = torch.cat([int8_per_token_matmul(x[m:m + 1], q, s, bias) for m in range(max(ROWS))])
        for M in ROWS:
            assert torch.equal(int8_per_token_matmul(x[:M], q, s, bias), alone[:M]), (N, K, M)
        xq, sx = quantize_rows_int8(x)
        ref = (xq.double() * sx.double()) @ (q.double() * s.double()[:, None]).T + bias.double()
        torch.testing.assert_close(alone.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert torch.equal(alone[2], bias)
        # the rounding acts: not the float product
        assert not torch.allclose(alone.double(), x.double() @ (q.double() * s.double()[:, None]).T + bias.double(),
                                  rtol=1e-6, atol=1e-6)


def test_quantize_rows():
    x = torch.tensor([[0.0, 0.0], [1.0, -2.0], [127.0, 63.5]])
    q, s = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and q.tolist() == [[0, 0], [64, -127], [127, 64]]  # 63.5 rounds half to even
    assert torch.equal(s.squeeze(1), torch.tensor([0.0, 2.0 / 127.0, 1.0]))


def test_flag_and_config():
    args = EngineArgs.from_cli_args(EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--activation-quantization", "int8_per_token", "--quantization", "int8"]))
    assert args.create_engine_config().model.activation_quantization == "int8_per_token"
    c = get_quantization_config("int8", activations="int8_per_token")
    assert c.int8_activations and c.per_token_activations
    assert not get_quantization_config("int8", activations="int8").per_token_activations
    int4 = get_quantization_config("int4", activations="int8_per_token")  # int4: the block-wise int8 path
    assert int4.int8_activations and not int4.per_token_activations


def test_model_close_to_float_activations_and_batch_invariant(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    kw = dict(quantization="int8", max_model_len=128, num_gpu_blocks_override=64, enable_prefix_caching=False,
              max_num_batched_tokens=16, max_num_seqs=8)
    llm = LLM(str(folder), activation_quantization="int8_per_token", **kw)
    model = llm.engine.model
    assert model.layers[0].mlp.gate_up_proj.quant_method.per_token
    assert model.lm_head.table_method.per_token
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100, 3, 9], [42] * 6]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)

    def run(m: LLM, ps):
        return greedy_with_logprobs(m, ps, sp)

    alone = [run(llm, [p])[0] for p in prompts]
    assert run(llm, prompts) == alone  # tokens and logprobs, bit for bit
    flt = run(LLM(str(folder), **kw), prompts)
    assert flt != alone  # the switch acts
    common = diffs = 0
    for (ta, la), (tb, lb) in zip(alone, flt):
        for i in range(min(len(ta), len(tb))):
            if ta[i] != tb[i]:
                break
            assert abs(la[i] - lb[i]) < 0.1, (i, la[i], lb[i])
            common += 1
            diffs += la[i] != lb[i]
    assert common >= len(prompts) and diffs > 0


@pytest.mark.skipif(not native.has_op("int8_linear_per_token"), reason="tokenmill._C without int8_linear_per_token")
def test_native_op_equals_torch_form_bit_for_bit():
    """csrc/w8a8_linear.cpp fuses the torch ops of the Python form: the same numbers, on 1 and 2 threads."""
    g = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    try:
        for N, K in ((17, 40), (300, 576), (49, 1536)):
            q, s = quantize_int8(torch.randn(N, K, generator=g))
            bias = torch.randn(N, generator=g)
            x = torch.randn(65, K, generator=g) * 3
            x[4] = 0.0
            xq, sx = quantize_rows_int8(x)
            plain = torch._int_mm(xq, q.t()).float() * sx * s
            ref = plain + bias
            for t in (1, 2):
                torch.set_num_threads(t)
                for M in (1, 7, 65):
                    y = torch.ops.tokenmill.int8_linear_per_token(x[:M], q, s, bias)
                    assert torch.equal(y, ref[:M]), (N, K, M, t)
                assert torch.equal(torch.ops.tokenmill.int8_linear_per_token(x, q, s, None), plain)
    finally:
        torch.set_num_threads(threads)
