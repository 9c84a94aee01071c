"""sample/argmax.py: row_argmax gives torch.argmax's index in every case (ties: the first; NaN: the first NaN;
rows of -inf; widths with and without a tail chunk; widths too small to chunk)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.sample.argmax import CHUNK, row_argmax


@pytest.mark.parametrize("width", [49152, 49152 + 5, 151936, 4 * CHUNK, 4 * CHUNK - 1, 3 * CHUNK + 17, 97])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_argmax(width, dtype):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g).to(dtype)
    x[1] = x[1].round()  # many ties at the top: the first wins
    x[2, :] = float("-inf")
    x[3, width - 1] = 100.0  # the maximum in the last column (a tail chunk's repeated column)
    x[4, [7, width // 2, width - 1]] = float("nan")  # the first NaN
    x[5, :] = 0.0  # one value everywhere: column 0
    x[6, [i % width for i in (CHUNK - 1, CHUNK, 3 * CHUNK)]] = 50.0  # tied maxima across chunk borders
    x[7, [width - 1, (4 * CHUNK) % width]] = 60.0  # tied: the tail's last column and a later chunk's first
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_empty_and_strided_rows():
    assert row_argmax(torch.randn(0, 8192)).shape == (0,)
    x = torch.randn(6, 2 * 8192)[:, ::2]  # not contiguous
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
