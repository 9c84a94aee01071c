"""--activation-quantization int8 for int8 / int4 weights at any number of rows of x.

Each row of x is quantized on its own (per 32 columns) and each output is summed in one fixed order, so:
- row m of an M-row call is bit for bit the call on that row alone, whatever M and the thread count: a
  request's greedy output does not depend on the batch it shares a step with, nor on prefill chunking;
- every row is, within float tolerance, the float64 product of the quantized x with the dequantized weights.
"""
from __future__ import annotations

import pytest
import torch

from int8_ref import needs_int8_dot, quantize_x
from tokenmill.layers.quantization.weight_only import dequantize_int4, quantize_int4, quantize_int8

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 65)
THREADS = (1, 2)


def make_x(M: int, K: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 1, M)[:, None]  # rows of different scales
    x[0, :32] = 0.0  # an all-zero block: scale 0
    return x


def check_rows(op, x: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, label: str) -> None:
    """op(x[:M]) for every M in ROWS, at 1 and 2 threads: each row bitwise op(row alone), and close to ref (float64
    x_quantized @ W^T), relative to bound (the same product of absolute values: the float sums' magnitude)."""
    threads = torch.get_num_threads()
    try:
        by_threads = []
        for t in THREADS:
            torch.set_num_threads(t)
            alone = torch.cat([op(x[m:m + 1]) for m in range(x.shape[0])])
            err = (alone.double() - ref).abs()
            worst = (err / bound).max().item()
            assert worst <= 1e-6, f"{label} threads={t}: |y - ref| / bound = {worst:.3g}"
            for M in ROWS:
                y = op(x[:M])
                assert y.shape == (M, ref.shape[1]) and y.dtype == torch.float32
                bad = [m for m in range(M) if not torch.equal(y[m], alone[m])]
                assert not bad, f"{label} threads={t} M={M}: rows {bad} differ from the row alone"
            by_threads.append(alone)
        assert torch.equal(by_threads[0], by_threads[1]), f"{label}: 1 and 2 threads differ"
    finally:
        torch.set_num_threads(threads)


@needs_int8_dot
@pytest.mark.parametrize("N,K", [(17, 32), (257, 96), (33, 576), (257, 1024)])
def test_int8_rows_independent_and_exact(N, K):
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3
    q, s = quantize_int8(w)
    q[0, :32] = -128  # the extreme weight: |w| = 128 still fits the unsigned x signed dot
    W = q.double() * s.double()[:, None]
    bias = torch.randn(N, generator=g)
    x = make_x(max(ROWS), K, g)
    xq = quantize_x(x)
    bound = xq.abs() @ W.abs().T + 1e-30
    for b in (None, bias):
        ref = xq @ W.T + (0 if b is None else b.double())
        check_rows(lambda xm: torch.ops.tokenmill.int8_linear(xm, q, s, b, True), x,
                   ref, bound + (0 if b is None else b.double().abs()), f"int8 N={N} K={K} bias={b is not None}")
    # The switch acts at every number of rows: x was rounded.
    assert not torch.equal(torch.ops.tokenmill.int8_linear(x, q, s, None, True),
                           torch.ops.tokenmill.int8_linear(x, q, s, None))


@needs_int8_dot
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("N,blocks", [(17, 1), (257, 3), (33, 8)], ids=["N17", "N257", "N33"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_int4_rows_independent_and_exact(group, N, blocks, symmetric):
    K = group * blocks
    g = torch.Generator().manual_seed(group * 1000 + N + symmetric)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3
    packed, s, z = quantize_int4(w, group, symmetric)
    W = dequantize_int4(packed, s, z, group).double()
    # Bound on the float sums: the kernel sums s * d_x * dot(q, x_q) and, apart, s * z * sum(x_q), so the
    # magnitudes are those of |q| and |z| separately (asymmetric zero points cancel most of the two).
    q = torch.stack([packed & 15, packed >> 4], -1).reshape(N, K).double()
    sz = s.double().repeat_interleave(group, 1)
    Wabs = (q + z.double().abs().repeat_interleave(group, 1)) * sz.abs()
    bias = torch.randn(N, generator=g)
    x = make_x(max(ROWS), K, g)
    xq = quantize_x(x)
    bound = xq.abs() @ Wabs.T + 1e-30
    for b in (None, bias):
        ref = xq @ W.T + (0 if b is None else b.double())
        check_rows(lambda xm: torch.ops.tokenmill.int4_linear(xm, packed, s, z, group, b, True), x,
                   ref, bound + (0 if b is None else b.double().abs()),
                   f"int4 g{group} sym={symmetric} N={N} K={K} bias={b is not None}")
    assert not torch.equal(torch.ops.tokenmill.int4_linear(x, packed, s, z, group, None, True),
                           torch.ops.tokenmill.int4_linear(x, packed, s, z, group, None))


@needs_int8_dot
def test_shapes_without_int8_kernel_take_the_float_path():
    """K not a multiple of 32 (int8), or groups of 16 columns (int4): the switch changes nothing, at any M."""
    g = torch.Generator().manual_seed(11)
    q, s = quantize_int8(torch.randn(9, 40, generator=g))
    packed, s4, z4 = quantize_int4(torch.randn(9, 64, generator=g), 16, False)
    for M in (1, 3, 9):
        x = torch.randn(M, 40, generator=g)
        assert torch.equal(torch.ops.tokenmill.int8_linear(x, q, s, None, True),
                           torch.ops.tokenmill.int8_linear(x, q, s, None))
        x = torch.randn(M, 64, generator=g)
        assert torch.equal(torch.ops.tokenmill.int4_linear(x, packed, s4, z4, 16, None, True),
                           torch.ops.tokenmill.int4_linear(x, packed, s4, z4, 16, None))


@needs_int8_dot
def test_other_dtypes_and_empty():
    g = torch.Generator().manual_seed(12)
    q, s = quantize_int8(torch.randn(20, 64, generator=g))
    x = torch.randn(6, 64, generator=g)
    y = torch.ops.tokenmill.int8_linear(x, q, s, None, True)
    assert torch.equal(torch.ops.tokenmill.int8_linear(x.double(), q, s, None, True), y)  # converted to float
    assert torch.ops.tokenmill.int8_linear(x[:0], q, s, None, True).shape == (0, 20)
    with pytest.raises(RuntimeError):
        torch.ops.tokenmill.int8_linear(x[:, :32], q, s, None, True)
