"""sample/argmax.py: row_argmax (the native kernel for float32) and chunked_argmax (the torch fallback) give
torch.argmax's index in every case (ties: the first; NaN: the first NaN; +inf; rows of -inf; widths with and without
a tail chunk or vector tail; widths too small to chunk; one row and many)."""
from __future__ import annotations

import pytest
import torch

from tokenmill import native
from tokenmill.sample.argmax import CHUNK, chunked_argmax, row_argmax

IMPLS = [pytest.param(row_argmax, id="row_argmax"), pytest.param(chunked_argmax, id="chunked")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("width", [49152, 49152 + 5, 151936, 4 * CHUNK, 4 * CHUNK - 1, 3 * CHUNK + 17, 97, 1, 15, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax(width, dtype, impl):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g).to(dtype)
    x[1] = x[1].round()  # many ties at the top: the first wins
    x[2, :] = float("-inf")
    x[3, width - 1] = 100.0  # the maximum in the last column (a tail chunk's repeated column)
    x[4, [7 % width, width // 2, width - 1]] = float("nan")  # the first NaN
    x[5, :] = 0.0  # one value everywhere: column 0
    x[6, [i % width for i in (CHUNK - 1, CHUNK, 3 * CHUNK)]] = 50.0  # tied maxima across chunk borders
    x[7, [width - 1, (4 * CHUNK) % width]] = 60.0  # tied: the tail's last column and a later chunk's first
    x[8, [width // 3, width - 1]] = float("inf")
    assert torch.equal(impl(x), x.argmax(dim=-1))
    for r in range(9):  # alone, as a batch-1 step asks
        assert torch.equal(impl(x[r : r + 1]), x[r : r + 1].argmax(dim=-1)), r


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_strided_rows(impl):
    assert impl(torch.randn(0, 8192)).shape == (0,)
    x = torch.randn(6, 2 * 8192)[:, ::2]  # not contiguous
    assert torch.equal(impl(x), x.argmax(dim=-1))


def test_native_kernel_on_many_rows_and_its_refusal():
    if not native.has_op("row_argmax"):
        pytest.skip("the native kernels are not built")
    x = torch.randn(300, 4099)  # rows past one work item's grain: several threads when there are
    x[::7, 5] = float("nan")
    assert torch.equal(torch.ops.tokenmill.row_argmax(x), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tokenmill.row_argmax(x.double())
