"""Interleaved rows (R16, csrc/gguf_r16.h): Q4_0 / Q4_1 / Q8_0 weights in groups of 16 rows, one vector lane per row.

The layout holds the same bytes as split rows (a round trip, and every path that dequantizes rows reads the same
floats); its float and int8 kernels equal a float64 reference at 1.7B-sized shapes and odd block counts, a row's
result does not depend on how many rows share the call, and the loader interleaves exactly where it should.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gguf_tiny import write_gguf
from int8_ref import quantize_x
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, native
from tokenmill.layers.quantization import gguf as gq

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

needs_r16 = pytest.mark.skipif(not (native.has_op("gguf_interleaves") and torch.ops.tokenmill.gguf_interleaves()),
                               reason="this build has no interleaved-row kernels (AVX-512 VNNI)")
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
# (N, K): one group with one block; odd block counts; 135M's and 1.7B's shapes (gate_up at 1.7B: 16384 x 2048)
SHAPES = [(16, 32), (48, 96), (960, 576), (576, 1536), (2048, 2048), (16384, 2048)]
ROWS = (1, 2, 3, 4, 5, 7)


def _weights(qtype, N, K, seed):
    rng = np.random.default_rng(seed)
    blocks = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype))
    W = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).reshape(N, K)).double()
    split = gq.split_rows(blocks, int(qtype))
    return W, split, gq.interleave_rows(split, int(qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_interleaving_round_trips_and_dequantizes_as_the_file(qtype):
    W, split, r16 = _weights(qtype, 64, 96, seed=1)
    assert r16.shape == split.shape and not torch.equal(r16, split)
    assert torch.equal(gq.deinterleave_rows(r16, int(qtype)), split)
    assert torch.equal(gq.reference_dequantize(r16, gq.R16 + int(qtype), 96).double(), W)
    assert gq.base_type(gq.R16 + int(qtype)) == int(qtype)
    assert gq.type_name(gq.R16 + int(qtype)).endswith("(interleaved rows)")


@needs_r16
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float_kernel_equals_float64_reference_and_is_row_invariant(qtype):
    g = torch.Generator().manual_seed(int(qtype))
    threads = torch.get_num_threads()
    try:
        for N, K in SHAPES:
            W, split, r16 = _weights(qtype, N, K, seed=N + K)
            qt = gq.R16 + int(qtype)
            x = torch.randn(max(ROWS), K, generator=g) * torch.rand(max(ROWS), 1, generator=g) * 4
            bias = torch.randn(N, generator=g)
            ref = x.double() @ W.T + bias.double()
            for t in (1, 2):
                torch.set_num_threads(t)
                alone = torch.cat([torch.ops.tokenmill.gguf_linear(x[m:m + 1], r16, qt, K, bias) for m in range(max(ROWS))])
                for M in ROWS:
                    y = torch.ops.tokenmill.gguf_linear(x[:M], r16, qt, K, bias)
                    assert torch.equal(y, alone[:M]), f"{qtype.name} N={N} K={K} M={M} threads={t}"
            torch.testing.assert_close(alone.double(), ref, rtol=1e-5, atol=2e-6 * math.sqrt(K) * ref.abs().max().item())
    finally:
        torch.set_num_threads(threads)


@needs_r16
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_kernel_equals_float64_reference_at_any_rows(qtype):
    """int8 activations: x rounded per 32 columns (int8_ref.quantize_x) times W in float64; every row alone equals
    the same row in a call of 2..65 rows (prefill chunks take this kernel too), on 1 and 2 threads."""
    g = torch.Generator().manual_seed(10 + int(qtype))
    threads = torch.get_num_threads()
    try:
        for N, K in SHAPES[:5]:
            W, split, r16 = _weights(qtype, N, K, seed=N * K)
            qt = gq.R16 + int(qtype)
            x = torch.randn(65, K, generator=g) * torch.rand(65, 1, generator=g) * 4
            x[1, :32] = 0.0  # an all-zero block: scale 0
            for t in (1, 2):
                torch.set_num_threads(t)
                alone = torch.cat([torch.ops.tokenmill.gguf_linear(x[m:m + 1], r16, qt, K, None, True) for m in range(65)])
                for M in (2, 3, 4, 5, 9, 33, 65):
                    y = torch.ops.tokenmill.gguf_linear(x[:M], r16, qt, K, None, True)
                    assert torch.equal(y, alone[:M]), f"{qtype.name} N={N} K={K} M={M} threads={t}"
            ref = quantize_x(x) @ W.T
            torch.testing.assert_close(alone.double(), ref, rtol=1e-4, atol=1e-5 * math.sqrt(K) * ref.abs().max().item())
            # the split rows' int8 kernel sums the same products in another order
            sx = torch.ops.tokenmill.gguf_linear(x, split, gq.SPLIT + int(qtype), K, None, True)
            torch.testing.assert_close(alone, sx, rtol=1e-4, atol=1e-5 * math.sqrt(K) * ref.abs().max().item())
    finally:
        torch.set_num_threads(threads)


@needs_r16
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_dequantizing_paths_give_the_split_rows_bits(qtype):
    """Batches (SGEMM on dequantized panels, bf16 panels) and gguf_dequantize read an interleaved row as the
    split row it was: the same bits."""
    N, K = 272, 576
    _, split, r16 = _weights(qtype, N, K, seed=5)
    x = torch.randn(40, K)
    for M, bf16 in ((8, False), (40, False), (40, True)):
        a = torch.ops.tokenmill.gguf_linear(x[:M], r16, gq.R16 + int(qtype), K, None, False, bf16)
        b = torch.ops.tokenmill.gguf_linear(x[:M], split, gq.SPLIT + int(qtype), K, None, False, bf16)
        assert torch.equal(a, b), (M, bf16)
    assert torch.equal(torch.ops.tokenmill.gguf_dequantize(r16, gq.R16 + int(qtype), K),
                       torch.ops.tokenmill.gguf_dequantize(split, gq.SPLIT + int(qtype), K))


@needs_r16
def test_rows_not_a_multiple_of_16_are_refused():
    _, split, _ = _weights(T.Q4_0, 32, 64, seed=2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tokenmill.gguf_linear(torch.randn(1, 64), split[:24], gq.R16 + int(T.Q4_0), 64, None)
    assert not gq.interleaves_rows(int(T.Q4_0), 24) and gq.interleaves_rows(int(T.Q4_0), 32)
    assert not gq.interleaves_rows(int(T.Q4_K), 32)  # K-quants keep the file's blocks


def _greedy(llm, prompts, n=16):
    sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, logprobs=2)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp, use_tqdm=False)]


@needs_r16
def test_a_model_interleaves_its_linears_and_answers_as_with_split_rows(tmp_path, monkeypatch):
    """A tiny Llama as Q4_0 / Q4_1 GGUF: with TOKENMILL_GGUF_INTERLEAVE=1 its linears (rows a multiple of 16)
    load interleaved, with 0 split, and both give the same greedy tokens with logprobs within float noise (the
    float kernels sum each block in another order)."""
    monkeypatch.setenv("TOKENMILL_GGUF_INTERLEAVE", "1")
    folder = make_tiny_model(tmp_path / "m", "llama", hidden_size=64, intermediate_size=128)
    path = write_gguf(folder, tmp_path / "m.gguf",
                      types=lambda name: T.Q4_1 if "ffn" in name else T.Q4_0 if "blk." in name else None)
    prompts = [[5, 17, 33, 101], list(range(40, 90))]

    def run():
        llm = LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64)
        layer = llm.engine.model.layers[0]
        return [layer.self_attn.qkv_proj.quant_method.qtype, layer.mlp.gate_up_proj.quant_method.qtype], _greedy(llm, prompts)

    types, got = run()
    assert types == [gq.R16 + T.Q4_0, gq.R16 + T.Q4_1]
    monkeypatch.setenv("TOKENMILL_GGUF_INTERLEAVE", "0")
    types, split = run()
    assert types == [gq.SPLIT + T.Q4_0, gq.SPLIT + T.Q4_1]
    for (tokens, lps), (stokens, slps) in zip(got, split):
        assert tokens == stokens
        for a, b in zip(lps, slps):
            assert a.keys() == b.keys()
            for k in a:
                assert abs(a[k].logprob - b[k].logprob) < 1e-4


@needs_r16
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_table_lookup_takes_back_the_rows_it_reads(qtype):
    W, split, r16 = _weights(qtype, 64, 96, seed=7)
    ids = torch.tensor([[0, 17, 63], [5, 5, 48]])
    got = gq.embedding_lookup(r16, gq.R16 + int(qtype), ids, 96)
    assert torch.equal(got, gq.embedding_lookup(split, gq.SPLIT + int(qtype), ids, 96))
    assert torch.equal(got.double(), W[ids])
    assert torch.equal(gq.interleaved_rows_at(r16, int(qtype), ids.reshape(-1)), split[ids.reshape(-1)])


@pytest.mark.skipif(not native.has_op("gguf_lookup"), reason="native kernels not built")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_native_lookup_gives_the_dequantized_rows(qtype):
    """tokenmill::gguf_lookup (what embedding_lookup runs): the rows' bits as gguf_dequantize gives them, for
    split and interleaved tables, repeated ids and int32 ids; ids outside the table are refused."""
    W, split, r16 = _weights(qtype, 64, 96, seed=8)
    ids = torch.tensor([63, 0, 17, 17, 48, 1])
    tables = [(split, gq.SPLIT + int(qtype))]
    if native.has_op("gguf_interleaves") and torch.ops.tokenmill.gguf_interleaves():
        tables.append((r16, gq.R16 + int(qtype)))
    for table, qt in tables:
        whole = torch.ops.tokenmill.gguf_dequantize(table, qt, 96)
        for i in (ids, ids.int()):
            got = torch.ops.tokenmill.gguf_lookup(table, qt, 96, i)
            assert torch.equal(got, whole[ids]) and torch.equal(got.double(), W[ids])
        assert torch.ops.tokenmill.gguf_lookup(table, qt, 96, ids[:0]).shape == (0, 96)
        for bad in (torch.tensor([64]), torch.tensor([-1])):
            with pytest.raises(RuntimeError, match="outside the table"):
                torch.ops.tokenmill.gguf_lookup(table, qt, 96, bad)


@needs_r16
def test_auto_layout_follows_the_measurement_and_caches_it_per_build(tmp_path, monkeypatch):
    """TOKENMILL_GGUF_INTERLEAVE=auto (the default): the layout that measured faster for the shape is used, the
    choice is stored in $TOKENMILL_CACHE/kernels.json under this CPU model, thread count and kernels build and
    read back without measuring again; another build measures again."""
    from tokenmill.layers.quantization import gguf_layout

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENMILL_GGUF_INTERLEAVE", raising=False)
    timings = {"split": 1.0, "r16": 2.0}  # R16 slower on this (pretend) CPU
    calls = []

    def fake_measure(qtype, rows, cols, int8):
        calls.append((qtype, rows, cols, int8))
        return dict(timings)

    monkeypatch.setattr(gguf_layout, "measure", fake_measure)
    gguf_layout.choose_r16.cache_clear()
    assert not gq.interleaves_rows(int(T.Q4_0), 64, 96)
    entry = json.loads((tmp_path / "cache" / "kernels.json").read_text())
    (k, v), = entry.items()
    assert v["layout"] == "split" and v["seconds"] == timings and gguf_layout.cpu_name() in k
    assert gq.interleaves_rows(int(T.Q4_0), 64, 96, int8_activations=False) is False and len(calls) == 1
    gguf_layout.choose_r16.cache_clear()  # a new process: reads the file, measures nothing
    assert not gq.interleaves_rows(int(T.Q4_0), 64, 96) and len(calls) == 1
    timings.update(split=2.0, r16=1.0)
    assert gq.interleaves_rows(int(T.Q4_0), 64, 96, int8_activations=True) and len(calls) == 2  # another mode
    monkeypatch.setattr(gguf_layout, "kernels_id", lambda: "another-build")
    gguf_layout.choose_r16.cache_clear()
    assert gq.interleaves_rows(int(T.Q4_0), 64, 96) and len(calls) == 3  # rebuilt kernels: measured again
    monkeypatch.setenv("TOKENMILL_GGUF_INTERLEAVE", "0")
    assert not gq.interleaves_rows(int(T.Q4_0), 64, 96)
    monkeypatch.setenv("TOKENMILL_GGUF_INTERLEAVE", "sometimes")
    with pytest.raises(ValueError, match="TOKENMILL_GGUF_INTERLEAVE"):
        gq.interleaves_rows(int(T.Q4_0), 64, 96)
    gguf_layout.choose_r16.cache_clear()


@needs_r16
def test_the_real_measurement_times_both_layouts():
    from tokenmill.layers.quantization import gguf_layout

    seconds = gguf_layout.measure(int(T.Q4_1), 576, 576, False)
    assert set(seconds) == {"split", "r16"} and all(0 < s < 1 for s in seconds.values())
