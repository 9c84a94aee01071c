"""GGUF weights kept as blocks (--quantization gguf, the default for .gguf files).

- Kernels: torch.ops.tokenmill.gguf_linear equals x @ dequantize(W)^T (gguf's own numpy dequantizer) for
  every type with a kernel (Q4_0/Q4_1/Q8_0 from gguf's quantizer, K-quants as random bytes with valid fp16
  scales), M over the decode widths (1, 2, 3, 7) and the SGEMM path (8, 33), N not a multiple of the vector
  width, several blocks, with a bias, on two threads; gguf_dequantize equals gguf.quants.dequantize.
- The pure-torch fallback (no kernels) gives the same products.
- Whole models: tiny GGUFs (tied Q8_0 embedding like SmolLM2; every kernel type, a merged layer of mixed
  types) load with blocks kept and give the dequantize-at-load path's greedy tokens; resident bytes are
  the file's block bytes.
- Tensor parallel: row-parallel shards cut at block boundaries, or a clear error.
- Bad files: truncated, or a tensor whose type needs more bytes than it has -> ValueError naming it.
- The real SmolLM2 (slow): same 32 greedy tokens as the dequantized model, resident <= 1.15x the file.
"""
from __future__ import annotations

from pathlib import Path
import contextlib
import math
import os
import struct

import numpy as np
import pytest
import torch

from gguf_tiny import quantize, smollm2_layout, write_gguf
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, native
from tokenmill.layers.quantization import get_quantization_config
from tokenmill.layers.quantization import gguf as gq
from tokenmill.model.gguf_file import GGUFFile

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
KERNEL_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]

needs_native = pytest.mark.skipif(not (native.available() and hasattr(torch.ops.tokenmill, "gguf_linear")),
                                  reason="tokenmill._C not built or without gguf_linear")


def random_blocks(qtype, N: int, K: int, seed: int = 0) -> np.ndarray:
    """[N, row_bytes]: gguf's quantizer where it has one, else random bytes with fp16 scales in range."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        return gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)

    def fp16_at(offset: int) -> None:
        v = (rng.random((N, K // block)) * 0.02 + 1e-3).astype(np.float16)
        raw[..., offset:offset + 2] = v.view(np.uint8).reshape(N, K // block, 2)

    if qtype in (T.Q4_K, T.Q5_K):
        fp16_at(0)  # d
        fp16_at(2)  # dmin
    else:
        fp16_at(208)  # Q6_K's d, after ql, qh and the int8 scales
    return raw.reshape(N, -1)


def _reference(x: torch.Tensor, blocks: np.ndarray, qtype, K: int, bias=None) -> torch.Tensor:
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(blocks.shape[0], K)).double()
    y = x.double() @ w.T
    return (y if bias is None else y + bias.double()).float()


@contextlib.contextmanager
def two_threads():
    """The kernels split their rows over threads from 2: run the case on two, restore the count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _k_for(qtype) -> int:
    return 3 * gguf.GGML_QUANT_SIZES[qtype][0]  # three blocks / super-blocks


@needs_native
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_kernel_matches_dequantized_reference(qtype):
    K, N = _k_for(qtype), 37
    blocks = random_blocks(qtype, N, K)
    wt = torch.from_numpy(blocks)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(N, generator=g)
    with two_threads():
        for M in (1, 2, 3, 7, 8, 33):
            x = torch.randn(M, K, generator=g)
            for b in (None, bias):
                y = torch.ops.tokenmill.gguf_linear(x, wt, int(qtype), K, b)
                ref = _reference(x, blocks, qtype, K, b)
                assert y.dtype == torch.float32 and y.shape == (M, N)
                torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K) * ref.abs().max().item(),
                                           msg=lambda m: f"{qtype.name} M={M} bias={b is not None}: {m}")


@needs_native
def test_fused_few_rows_path_behind_its_switch():
    """2-7 rows of x dequantize each weight row once (the default); TOKENMILL_GGUF_DEQUANT_ROWS=0 takes the
    fused register path instead (read once per process, so checked in a child)."""
    import subprocess
    import sys

    code = (
        "import math, torch, gguf, sys; sys.path[:0] = ['tests', 'tests/layers/quantization']; import test_gguf_blocks as t\n"
        "from tokenmill import native\n"
        "for q in t.KERNEL_TYPES:\n"
        "    K = t._k_for(q); b = t.random_blocks(q, 9, K); x = torch.randn(3, K)\n"
        "    y = torch.ops.tokenmill.gguf_linear(x, torch.from_numpy(b), int(q), K, None)\n"
        "    ref = t._reference(x, b, q, K, None)\n"
        "    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K) * ref.abs().max().item())\n"
        "print('ok')\n")
    env = dict(os.environ, TOKENMILL_GGUF_DEQUANT_ROWS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[3]))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@needs_native
def test_prefetch_distance_never_changes_a_result(tmp_path):
    """The decode kernels prefetch the weight stream TOKENMILL_GGUF_PREFETCH_BYTES ahead (read once per process:
    children). Off, the default, a line's worth and far past the weights give the same bits, for every kernel
    type, file-order and split rows, one and three rows of x, float and int8 activations, on two threads."""
    import subprocess
    import sys

    code = (
        "import sys, torch; sys.path[:0] = ['tests', 'tests/layers/quantization']; import test_gguf_blocks as t\n"
        "from tokenmill.layers.quantization import gguf as gq\n"
        "torch.set_num_threads(2); torch.manual_seed(0); out = []\n"
        "for q in t.KERNEL_TYPES:\n"
        "    K = t._k_for(q); b = torch.from_numpy(t.random_blocks(q, 301, K))\n"
        "    forms = [(b, int(q))] + ([(gq.split_rows(b, int(q)), int(q) + gq.SPLIT)] if int(q) in gq.SPLIT_BASES else [])\n"
        "    for w, qt in forms:\n"
        "        for M in (1, 3):\n"
        "            x = torch.randn(M, K)\n"
        "            for x8 in (False, True):\n"
        "                out.append(torch.ops.tokenmill.gguf_linear(x, w, qt, K, None, x8))\n"
        "torch.save(out, sys.argv[1])\n")
    root = str(Path(__file__).resolve().parents[3])
    results = []
    for dist in ("0", None, "64", "100000000"):
        env = dict(os.environ)
        env.pop("TOKENMILL_GGUF_PREFETCH_BYTES", None)
        if dist is not None:
            env["TOKENMILL_GGUF_PREFETCH_BYTES"] = dist
        path = tmp_path / f"out_{dist}.pt"
        proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                              timeout=300, cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results.append(torch.load(path))
    for other in results[1:]:
        assert len(other) == len(results[0]) and all(torch.equal(a, b) for a, b in zip(results[0], other))


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_few_rows_over_split_blocks_equal_batch_one_bit_for_bit(qtype):
    """2-7 rows of x over split blocks (a request verifying drafts, a few decodes) share each block's widening
    and keep each row's batch-1 summation order: every row equals its batch-1 result exactly, so speculative
    verification scores a row as plain decoding would."""
    K, N = 7 * 32, 37
    split = gq.split_rows(torch.from_numpy(random_blocks(qtype, N, K, seed=8)), int(qtype))
    sq = gq.SPLIT + int(qtype)
    g = torch.Generator().manual_seed(9)
    with two_threads():
        for M in range(2, 8):
            x = torch.randn(M, K, generator=g)
            y = torch.ops.tokenmill.gguf_linear(x, split, sq, K, None)
            for i in range(M):
                assert torch.equal(y[i:i + 1], torch.ops.tokenmill.gguf_linear(x[i:i + 1], split, sq, K, None)), (M, i)


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_split_rows_at_real_sizes_and_every_tail(qtype):
    """The decode kernels over split rows take four blocks per step into four accumulators: at SmolLM2-1.7B's
    row lengths (2048, 8192) and at lengths leaving 1, 2 and 3 blocks after the last step, float and int8
    activations equal their float64 references, and 2-4 rows of x equal their batch-1 results bit for bit."""
    from int8_ref import quantize_x

    g = torch.Generator().manual_seed(11)
    with two_threads():
        for K in (2048, 8192, 2048 + 32, 2048 + 64, 2048 + 96):
            N = 24
            blocks = random_blocks(qtype, N, K, seed=K)
            split = gq.split_rows(torch.from_numpy(blocks), int(qtype))
            sq = gq.SPLIT + int(qtype)
            w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(N, K)).double()
            x = torch.randn(4, K, generator=g)
            for x8 in (False, True):
                y = torch.ops.tokenmill.gguf_linear(x, split, sq, K, None, x8)
                ref = ((quantize_x(x) if x8 else x.double()) @ w.T).float()
                torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K) * ref.abs().max().item(),
                                           msg=lambda m: f"{qtype.name} K={K} x8={x8}: {m}")
                for i in range(4):
                    one = torch.ops.tokenmill.gguf_linear(x[i:i + 1], split, sq, K, None, x8)
                    assert torch.equal(y[i:i + 1], one), (K, x8, i)


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_batched_path_many_panels_under_inference_mode(qtype):
    """The batched path splits a large weight into per-thread panels; the engine calls it under
    torch.inference_mode, which worker threads must honour when they write their panels of y."""
    N, K = 1536, 512
    blocks = random_blocks(qtype, N, K, seed=5)
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(5))
    with two_threads():
        with torch.inference_mode():
            y = torch.ops.tokenmill.gguf_linear(x, torch.from_numpy(blocks), int(qtype), K, None)
    ref = _reference(x, blocks, qtype, K)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K) * ref.abs().max().item())


@needs_native
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_op_equals_gguf(qtype):
    K = _k_for(qtype)
    blocks = random_blocks(qtype, 21, K, seed=2)
    got = torch.ops.tokenmill.gguf_dequantize(torch.from_numpy(blocks), int(qtype), K)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(21, K))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_split_rows_equal_the_file_blocks(qtype):
    """The kernels' split layout (scales, mins, then quants per row): a lossless reordering; every path over it
    (batch 1 float and int8 activations, the few-rows and SGEMM paths, dequantize, the torch reference) gives
    what the file's order gives."""
    K, N = 7 * 32, 37  # an odd number of blocks: the kernels' pair loop has a tail
    blocks = torch.from_numpy(random_blocks(qtype, N, K, seed=3))
    split = gq.split_rows(blocks, int(qtype))
    assert split.shape == blocks.shape and not torch.equal(split, blocks)
    assert torch.equal(gq.unsplit_rows(split, int(qtype)), blocks)
    sq = gq.SPLIT + int(qtype)
    assert gq.base_type(sq) == int(qtype) and gq.block_format(sq) == gq.block_format(int(qtype))
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(N, generator=g)
    with two_threads():
        for M in (1, 2, 3, 7, 8, 33):
            x = torch.randn(M, K, generator=g)
            ref = _reference(x, blocks.numpy(), qtype, K, bias)
            got = torch.ops.tokenmill.gguf_linear(x, split, sq, K, bias)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * math.sqrt(K) * ref.abs().max().item())
        x = torch.randn(1, K, generator=g)
        x8_file = torch.ops.tokenmill.gguf_linear(x, blocks, int(qtype), K, None, True)
        x8_split = torch.ops.tokenmill.gguf_linear(x, split, sq, K, None, True)
        torch.testing.assert_close(x8_split, x8_file, rtol=1e-5, atol=1e-5 * x8_file.abs().max().item())
    deq = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).reshape(N, K))
    torch.testing.assert_close(torch.ops.tokenmill.gguf_dequantize(split, sq, K), deq, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gq.reference_dequantize(split, sq, K), deq, rtol=0, atol=0)


@needs_native
def test_kernel_rejects_bad_arguments():
    blocks = torch.from_numpy(random_blocks(T.Q4_0, 4, 64))
    with pytest.raises(RuntimeError, match="row"):
        torch.ops.tokenmill.gguf_linear(torch.randn(1, 96), blocks, int(T.Q4_0), 96, None)  # rows are 64 wide
    with pytest.raises(RuntimeError, match="no block kernel"):
        torch.ops.tokenmill.gguf_linear(torch.randn(1, 64), blocks, int(T.Q5_0), 64, None)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.tokenmill.gguf_linear(torch.randn(1, 32), blocks, int(T.Q4_0), 64, None)


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_fallback_equals_kernel(monkeypatch, qtype):
    K = _k_for(qtype)
    wt = torch.from_numpy(random_blocks(qtype, 19, K, seed=3))
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(5))
    native_y = gq.gguf_matmul(x, wt, int(qtype), K)
    assert gq._NATIVE is True
    monkeypatch.setattr(gq, "_NATIVE", False)
    torch.testing.assert_close(gq.gguf_matmul(x, wt, int(qtype), K), native_y, rtol=1e-4,
                               atol=1e-5 * math.sqrt(K) * native_y.abs().max().item())
    rows = torch.tensor([3, 0, 18])
    torch.testing.assert_close(gq.dequantize(wt[rows], int(qtype), K),
                               torch.from_numpy(gguf.quants.dequantize(wt.numpy()[rows.numpy()], qtype)))


def test_gguf_is_the_default_for_gguf_files():
    assert isinstance(get_quantization_config(None, model="m.gguf"), gq.GGUFConfig)
    assert get_quantization_config("none", model="m.gguf") is None
    assert get_quantization_config(None, model="folder") is None
    with pytest.raises(ValueError, match="unknown quantization"):
        get_quantization_config("q4", model="m.gguf")


# ---------------------------------------------------------------------------------------------------
# Tensor parallel: row-parallel shards
# ---------------------------------------------------------------------------------------------------

def test_row_parallel_shard_cuts_at_block_boundaries():
    from tokenmill.layers.linear import RowParallelLinear

    K, N = 128, 9
    blocks = random_blocks(T.Q4_1, N, K, seed=4)
    full = torch.from_numpy(gguf.quants.dequantize(blocks, T.Q4_1).reshape(N, K))
    x = torch.randn(2, K)
    for rank in range(2):
        layer = RowParallelLinear(K, N, quant_method=gq.GGUFLinearMethod(int(T.Q4_1)), tp_rank=rank, tp_size=2)
        layer.weight.weight_loader(layer.weight, torch.from_numpy(blocks.copy()))
        part = x[:, rank * 64:(rank + 1) * 64]
        y = layer.quant_method.apply(layer, part)  # the partial sum, before the all-reduce
        torch.testing.assert_close(y, part @ full[:, rank * 64:(rank + 1) * 64].T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="whole number of Q4_1 blocks"):
        RowParallelLinear(96, N, quant_method=gq.GGUFLinearMethod(int(T.Q4_1)), tp_rank=0, tp_size=2)


# ---------------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 33, 101], list(range(40, 90)), [200, 201, 7, 9, 11, 300, 2, 45, 46, 47, 48]]


def _greedy(llm: LLM, n: int = 24):
    sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def _llm(path, folder, quantization):
    return LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64,
               quantization=quantization)


def _block_bytes(path) -> int:
    f = GGUFFile(str(path))
    return sum(f.raw(t).nbytes for t in f.tensors if t.ggml_type in gq.KERNEL_TYPES)


def _float_bytes(path) -> int:
    f = GGUFFile(str(path))
    return sum(int(np.prod(t.shape)) * 4 for t in f.tensors if t.ggml_type not in gq.KERNEL_TYPES)


def test_tied_q8_0_embedding_and_q4_linears_match_dequantized(tmp_path):
    """SmolLM2's layout: linears Q4_x, token_embd Q8_0 shared with the LM head; attn_output as Q5_0, a type
    without a kernel, is dequantized at load."""
    folder = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=True)

    path = write_gguf(folder, tmp_path / "m.gguf", types=smollm2_layout)
    kept = _llm(path, folder, "gguf")
    model = kept.engine.model
    assert model.embed_tokens.weight.dtype == torch.uint8 and model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    # Q4_0 / Q4_1 / Q8_0 in the kernels' split rows (Q4_0 / Q4_1 linears interleaved by 16 rows where the build
    # has those kernels), the tied table once for both of its users
    for layer, qt in ((model.layers[0].self_attn.qkv_proj, T.Q4_0), (model.layers[0].mlp.gate_up_proj, T.Q4_1)):
        form = gq.R16 if gq.interleaves_rows(int(qt), layer.weight.shape[0], layer.input_size_per_partition) else gq.SPLIT
        assert layer.quant_method.qtype == form + qt
    table = model.embed_tokens
    form = gq.R16 if gq.interleaves_rows(int(T.Q8_0), table.weight.shape[0], table.embedding_dim) else gq.SPLIT
    assert model.embed_tokens.table_method.qtype == model.lm_head.table_method.qtype == form + T.Q8_0
    assert kept.engine.facts.weight_bytes == _block_bytes(path) + _float_bytes(path)
    got = _greedy(kept)
    ref_llm = _llm(path, folder, "none")
    assert ref_llm.engine.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert got == _greedy(ref_llm)


def test_every_kernel_type_and_a_mixed_merged_layer(tmp_path):
    """K-quants need 256-wide rows: hidden 256, MLP 512. Layer 1's qkv mixes Q4_K and Q6_K, so it is
    dequantized at load; everything else keeps its blocks."""
    folder = make_tiny_model(tmp_path / "k", "llama", hidden_size=256, intermediate_size=512)
    table = {
        "blk.0.attn_q": T.Q4_K, "blk.0.attn_k": T.Q4_K, "blk.0.attn_v": T.Q4_K, "blk.0.attn_output": T.Q5_K,
        "blk.0.ffn_gate": T.Q4_0, "blk.0.ffn_up": T.Q4_0, "blk.0.ffn_down": T.Q6_K,
        "blk.1.attn_q": T.Q4_K, "blk.1.attn_k": T.Q4_K, "blk.1.attn_v": T.Q6_K, "blk.1.attn_output": T.Q8_0,
        "blk.1.ffn_gate": T.Q4_1, "blk.1.ffn_up": T.Q4_1, "blk.1.ffn_down": T.Q5_K,
        "token_embd": T.Q6_K, "output": T.Q8_0,
    }
    path = write_gguf(folder, tmp_path / "k.gguf", types=lambda name: table.get(name.rsplit(".", 1)[0]))
    kept = _llm(path, folder, "gguf")
    model = kept.engine.model
    assert model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float32  # mixed Q4_K + Q6_K
    for layer in (model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj,
                  model.layers[0].mlp.down_proj, model.layers[1].mlp.gate_up_proj, model.lm_head, model.embed_tokens):
        assert layer.weight.dtype == torch.uint8, layer
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert _greedy(kept) == _greedy(_llm(path, folder, "none"))


def _header_tensor_type_offset(path, name: str) -> int:
    """Byte position of `name`'s ggml type in the tensor-info header."""
    data = open(path, "rb").read(1 << 16)
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos + 4 + 8 * n_dims


def test_truncated_or_corrupt_tensor_is_named(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    path = write_gguf(folder, tmp_path / "m.gguf", T.Q4_0)
    last = max(GGUFFile(str(path)).tensors, key=lambda t: t.offset).name
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"tensor {last} .*truncated or corrupt"):
        GGUFFile(str(truncated)).raw(next(t for t in GGUFFile(str(truncated)).tensors if t.name == last))
    with pytest.raises(ValueError, match=last):
        _llm(truncated, folder, "gguf")
    # A Q4_0 tensor relabelled Q8_0 needs 34 bytes per block where the file holds 18.
    corrupt = tmp_path / "corrupt.gguf"
    raw = bytearray(path.read_bytes())
    pos = _header_tensor_type_offset(path, "blk.0.attn_q.weight")
    assert struct.unpack_from("<I", raw, pos)[0] == int(T.Q4_0)
    struct.pack_into("<I", raw, pos, int(T.Q8_0))
    corrupt.write_bytes(bytes(raw))
    for q in ("gguf", "none"):
        with pytest.raises(ValueError, match="blk.0.attn_q.weight"):
            _llm(corrupt, folder, q)


def test_gguf_on_a_folder_is_an_error(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="not one"):
        LLM(str(folder), max_model_len=64, num_gpu_blocks_override=16, quantization="gguf")


@pytest.mark.slow
def test_smollm2_blocks_match_dequantized_and_stay_small():
    from tokenmill.model.default import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the embedded SmolLM2 GGUF is not installed")
    sp = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    f = GGUFFile(path)
    tensor_bytes = sum(f.raw(t).nbytes for t in f.tensors)
    outs = {}
    for q in ("gguf", "none"):
        llm = LLM(path, max_model_len=256, num_gpu_blocks_override=32, quantization=q)
        if q == "gguf":
            assert llm.engine.facts.weight_bytes <= 1.15 * tensor_bytes
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    assert outs["gguf"] == outs["none"]
