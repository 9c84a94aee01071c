"""The native MXFP4 linear (csrc/mxfp4_linear.cpp, torch.ops.tokenmill.mxfp4_linear) against a float64 reference
whose weights are decoded here with numpy from the OCP microscaling spec (not the table mxfp4.py uses): an e2m1 code
is sign, 2 exponent bits and 1 mantissa bit (exponent 0: m * 0.5; else 2^(e-1) * (1 + m/2)), element 2i of a block
in the low nibble of byte i, the block's e8m0 scale 2^(s-127). gpt-oss expert shapes, 1..8 rows of x (the
register-decode path) and more (the decode-then-SGEMM path), odd row counts, an odd block count; on the register
path 1 and 2 threads give the same bits, and a row of x gives the same bits alone or among others. The torch fallback equals F.linear on
dequantize_mxfp4's weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill import native
from tokenmill.layers.quantization.mxfp4 import NATIVE_ENV, dequantize_mxfp4, mxfp4_linear

needs_kernel = pytest.mark.skipif(not native.has_op("mxfp4_linear"), reason="tokenmill._C without mxfp4_linear")


def spec_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [N, G, 16], scales uint8 [N, G] -> float64 [N, G * 32], from the spec's bit fields."""
    code = np.arange(16)
    sign = np.where(code & 0x8, -1.0, 1.0)
    e, m = (code >> 1) & 0x3, code & 0x1
    e2m1 = sign * np.where(e == 0, m * 0.5, np.exp2(e - 1.0) * (1.0 + m / 2.0))  # by code
    codes = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    values = e2m1[codes] * np.exp2(scales.astype(np.float64) - 127.0)[..., None]
    return values.reshape(blocks.shape[0], -1)


def random_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 132, (n, k // 32), dtype=torch.uint8, generator=g)  # gpt-oss-like powers of two
    return blocks, scales


def check_against_spec(y: torch.Tensor, x: torch.Tensor, w64: np.ndarray, bias: torch.Tensor | None = None) -> None:
    """float32 accumulation: within a few ulps of sum |x| |w| of the float64 result."""
    x64 = x.double().numpy()
    ref = x64 @ w64.T + (0.0 if bias is None else bias.double().numpy())
    scale = np.abs(x64) @ np.abs(w64).T + 1e-30
    err = np.abs(y.double().numpy() - ref) / scale
    assert err.max() < 1e-5, f"worst relative error {err.max():.3g}"


# (N, K): gpt-oss-20b's down (2880 x 2880) and gate_up (5760 x 2880, both halves), an odd row count, an odd
# number of blocks per row (89), and one block.
SHAPES = [(2880, 2880), (5760, 2880), (2877, 2880), (301, 2848), (7, 32)]


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_spec_reference(n, k):
    blocks, scales = random_weight(n, k, seed=n + k)
    w64 = spec_dequantize(blocks.numpy(), scales.numpy())
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1))
    gemm_from = torch.ops.tokenmill.mxfp4_gemm_min_rows()
    for m in (1, 2, 3, 4, 5, 7, 8, gemm_from - 1, gemm_from, 33):
        y = torch.ops.tokenmill.mxfp4_linear(x[:m], blocks, scales, None)
        assert y.shape == (m, n) and y.dtype == torch.float32
        check_against_spec(y, x[:m], w64)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 8, "last"])
def test_kernel_bits_do_not_depend_on_threads(m):
    """Below the SGEMM threshold ("last": the most rows there), each output by one thread in a fixed order. (From
    the threshold on, SGEMM's blocking may differ with the thread count.)"""
    if m == "last":
        m = torch.ops.tokenmill.mxfp4_gemm_min_rows() - 1
    blocks, scales = random_weight(2880, 2880, seed=3)
    x = torch.randn(m, 2880, generator=torch.Generator().manual_seed(m))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.tokenmill.mxfp4_linear(x, blocks, scales, None)
        torch.set_num_threads(2)
        two = torch.ops.tokenmill.mxfp4_linear(x, blocks, scales, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_kernel_row_alone_equals_row_among_others():
    """Below the SGEMM threshold a row's result is the same bits whatever rows share the call (batching does not
    change a sequence's numbers)."""
    blocks, scales = random_weight(640, 2880, seed=5)
    rows = min(8, torch.ops.tokenmill.mxfp4_gemm_min_rows() - 1)
    x = torch.randn(rows, 2880, generator=torch.Generator().manual_seed(2))
    together = torch.ops.tokenmill.mxfp4_linear(x, blocks, scales, None)
    for i in range(rows):
        assert torch.equal(torch.ops.tokenmill.mxfp4_linear(x[i:i + 1], blocks, scales, None)[0], together[i])


@needs_kernel
@pytest.mark.parametrize("m", [1, 6, 40])
def test_kernel_bias_and_bfloat16_input(m):
    blocks, scales = random_weight(96, 2880, seed=7)
    w64 = spec_dequantize(blocks.numpy(), scales.numpy())
    x = torch.randn(m, 2880, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(96, generator=torch.Generator().manual_seed(4))
    y = torch.ops.tokenmill.mxfp4_linear(x, blocks, scales, bias)
    check_against_spec(y, x.float(), w64, bias)  # x's bf16 values, exactly widened, against float64
    yb = mxfp4_linear(x, blocks, scales, bias.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, y.bfloat16(), atol=0.05, rtol=0.01)


@needs_kernel
def test_kernel_refuses_bad_shapes():
    blocks, scales = random_weight(8, 64, seed=0)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.tokenmill.mxfp4_linear(torch.randn(1, 32), blocks, scales, None)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.tokenmill.mxfp4_linear(torch.randn(1, 64), blocks, scales[:, :1].contiguous(), None)
    with pytest.raises(RuntimeError, match="blocks must be"):
        torch.ops.tokenmill.mxfp4_linear(torch.randn(1, 64), blocks.reshape(8, 32), scales, None)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_mxfp4_linear_paths(path, monkeypatch):
    """The layer's entry point: the kernel where built, else (and with TOKENMILL_MXFP4_NATIVE=0) exactly F.linear on
    the torch decode; both against the spec reference."""
    if path == "native" and not native.has_op("mxfp4_linear"):
        pytest.skip("tokenmill._C without mxfp4_linear")
    monkeypatch.setenv(NATIVE_ENV, "1" if path == "native" else "0")
    blocks, scales = random_weight(320, 2880, seed=9)
    w64 = spec_dequantize(blocks.numpy(), scales.numpy())
    bias = torch.randn(320, generator=torch.Generator().manual_seed(6))
    for m in (1, 3, 24):
        x = torch.randn(m, 2880, generator=torch.Generator().manual_seed(m))
        y = mxfp4_linear(x, blocks, scales, bias)
        check_against_spec(y, x, w64, bias)
        if path == "torch":
            assert torch.equal(y, F.linear(x, dequantize_mxfp4(blocks, scales), bias))
