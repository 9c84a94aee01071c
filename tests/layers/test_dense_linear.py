"""csrc/dense_linear.cpp: the float32 few-row linear (torch.ops.tokenmill.dense_linear).

Against a float64 reference over shapes with K tails and odd N, with and without bias, at 1 and 2 threads;
rows below the crossover computed the same whatever the other rows (bitwise equal to the single-row call);
other dtypes and layouts answered as at::linear does. Behaviour only: speed is measured elsewhere."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from tokenmill import native

pytestmark = pytest.mark.skipif(not native.has_op("dense_linear"), reason="native dense_linear not built")

MS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 33, 65]
KS = [1, 7, 16, 40, 577]
NS = [1, 17, 257, 1000]
# Every M up to here takes the own kernel (DL_MAX_ROWS in dense_linear.cpp): rows there are independent.
OWN_MAX_ROWS = 32


def op(x, w, b=None):
    return torch.ops.tokenmill.dense_linear(x, w, b)


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = x.double() @ w.double().T
    if b is not None:
        ref = ref + b.double()
    assert y.shape == ref.shape and y.dtype == x.dtype
    K = w.shape[1]
    tol = max(K, 1) ** 0.5 * max(ref.abs().max().item(), 1e-30) * 1e-6
    err = (y.double() - ref).abs().max().item() if y.numel() else 0.0
    assert err <= tol, f"max error {err} > {tol}"


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("K", KS)
def test_matches_float64_reference(K, bias, nthreads):
    g = torch.Generator().manual_seed(K * 7 + bias)
    with threads(nthreads):
        for N in NS:
            w = torch.randn(N, K, generator=g)
            b = torch.randn(N, generator=g) if bias else None
            for M in MS:
                x = torch.randn(M, K, generator=g)
                check(op(x, w, b), x, w, b)


@pytest.mark.skipif(os.environ.get("TOKENMILL_DENSE_LINEAR") == "0", reason="own kernel switched off")
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("K,N", [(7, 17), (40, 257), (577, 1000), (576, 1536)])
def test_rows_independent_of_each_other(K, N, nthreads):
    """Below the crossover a row's result is bitwise the single-row call's, whatever the other rows."""
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    x = torch.randn(OWN_MAX_ROWS, K, generator=g)
    with threads(nthreads):
        singles = [op(x[i:i + 1], w, b) for i in range(OWN_MAX_ROWS)]
        for M in range(1, OWN_MAX_ROWS + 1):
            y = op(x[:M], w, b)
            for i in range(M):
                assert torch.equal(y[i:i + 1], singles[i]), (M, i)
        # the thread count does not change a row either
        with threads(1):
            one = op(x, w, b)
        assert torch.equal(op(x, w, b), one)


def test_non_contiguous_x():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(33, 40, generator=g)
    b = torch.randn(33, generator=g)
    big = torch.randn(5, 100, generator=g)
    for x in (big[:, 10:50],                                  # rows with a stride, columns contiguous
              torch.randn(40, 5, generator=g).T,              # column-major
              big[::2, :80:2],                                # both strided
              torch.randn(1, 40, generator=g).expand(4, 40)):  # one row repeated (stride 0)
        y = op(x, w, b)
        check(y, x, w, b)
        assert torch.equal(y, op(x.contiguous(), w, b))


def test_other_layouts_and_dtypes_follow_at_linear():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 33, generator=g)
    x = torch.randn(3, 33, generator=g)
    b = torch.randn(40, generator=g)
    # non-contiguous weight (a transposed view): at::linear's answer
    wt = torch.randn(33, 40, generator=g).T
    assert torch.equal(op(x, wt, b), F.linear(x, wt, b))
    # float64 / bfloat16: at::linear in that dtype
    for dt in (torch.float64, torch.bfloat16):
        xd, wd, bd = x.to(dt), w.to(dt), b.to(dt)
        y = op(xd, wd, bd)
        assert y.dtype == dt and torch.equal(y, F.linear(xd, wd, bd))
    # a 3-D x: at::linear over the last dim
    x3 = torch.randn(2, 3, 33, generator=g)
    assert torch.equal(op(x3, w, b), F.linear(x3, w, b))
    # bias of another dtype with float32 x and w: at::linear decides
    with pytest.raises(RuntimeError):
        F.linear(x, w, b.double())
    with pytest.raises(RuntimeError):
        op(x, w, b.double())


def test_empty_shapes():
    w = torch.randn(17, 8)
    assert op(torch.randn(0, 8), w).shape == (0, 17)
    assert op(torch.randn(3, 8), torch.randn(0, 8)).shape == (3, 0)
    b = torch.randn(5)
    y = op(torch.randn(2, 0), torch.randn(5, 0), b)
    assert torch.equal(y, b.expand(2, 5))


def test_unquantized_linear_uses_op():
    """UnquantizedLinearMethod.apply: 2-D float32 goes through the op, the same numbers as calling it."""
    from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod, _dense_linear_op

    layer = torch.nn.Module()
    m = UnquantizedLinearMethod()
    m.create_weights(layer, 40, [17, 16], 40, 33, torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
    b = torch.randn(33)
    x = torch.randn(3, 40)
    y = m.apply(layer, x, b)
    if _dense_linear_op() is not None:
        assert torch.equal(y, op(x, layer.weight, b))
    check(y, x, layer.weight, b)
    # 3-D input keeps F.linear
    x3 = torch.randn(2, 3, 40)
    assert torch.equal(m.apply(layer, x3, b), F.linear(x3, layer.weight, b))
