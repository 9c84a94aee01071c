"""int8 activations on GGUF weights at any number of rows (--activation-quantization int8).

Each row of x is quantized on its own and each output summed in one fixed order, so a row's result is bit for
bit the same whether it is multiplied alone, with a few decodes, or inside a long prefill, on 1 or 2 threads:
a request's greedy output does not depend on what else is in the batch.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compare import greedy_with_logprobs
from gguf_tiny import write_gguf
from int8_ref import needs_int8_dot, quantize_x
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.layers.quantization import gguf as gq

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 65)


@needs_int8_dot
@pytest.mark.parametrize("split", [False, True], ids=["file", "split"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_rows_equal_single_row_and_reference(qtype, split):
    rng = np.random.default_rng(int(qtype) + 10 * split)
    g = torch.Generator().manual_seed(int(qtype))
    threads = torch.get_num_threads()
    try:
        for N, K in ((37, 96), (301, 576)):
            blocks = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype))
            W = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).reshape(N, K)).double()
            wt, qt = (gq.split_rows(blocks, int(qtype)), gq.SPLIT + int(qtype)) if split else (blocks, int(qtype))
            bias = torch.randn(N, generator=g)
            x = torch.randn(max(ROWS), K, generator=g) * torch.rand(max(ROWS), 1, generator=g) * 4
            x[1, :32] = 0.0  # an all-zero block: scale 0
            for t in (1, 2):
                torch.set_num_threads(t)
                alone = torch.cat([torch.ops.tokenmill.gguf_linear(x[m:m + 1], wt, qt, K, bias, True)
                                   for m in range(max(ROWS))])
                for M in ROWS:
                    y = torch.ops.tokenmill.gguf_linear(x[:M], wt, qt, K, bias, True)
                    assert torch.equal(y, alone[:M]), f"{qtype.name} split={split} N={N} K={K} M={M} threads={t}"
            ref = quantize_x(x) @ W.T + bias.double()
            torch.testing.assert_close(alone.double(), ref, rtol=1e-4, atol=1e-4 * math.sqrt(K) * ref.abs().max().item())
            assert not torch.equal(alone, torch.ops.tokenmill.gguf_linear(x, wt, qt, K, bias, False))
    finally:
        torch.set_num_threads(threads)


@needs_int8_dot
def test_greedy_output_independent_of_batch(tmp_path):
    """int8 activations on a GGUF model: each prompt decoded alone equals the same prompts batched together with
    chunked prefill, and the switch is really on (the output differs from float activations somewhere)."""
    folder = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=True)
    path = write_gguf(folder, tmp_path / "m.gguf", types=lambda n: T.Q8_0 if "token_embd" in n
                      else T.Q4_1 if "ffn" in n else T.Q4_0)
    kw = dict(tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64, enable_prefix_caching=False,
              max_num_batched_tokens=16, max_num_seqs=8)
    llm = LLM(str(path), activation_quantization="int8", **kw)
    assert llm.engine.model.layers[0].mlp.gate_up_proj.quant_method.int8_activations
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [100, 3, 9], [42] * 6,
               list(range(200, 240))]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)

    def run(model: LLM, ps):
        return greedy_with_logprobs(model, ps, sp)

    alone = [run(llm, [p])[0] for p in prompts]
    batched = run(llm, prompts)
    assert batched == alone  # tokens and logprobs, bit for bit
    flt = run(LLM(str(path), **kw), prompts)
    assert flt != batched
