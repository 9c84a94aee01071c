"""Shared by the int8-activation tests: the skip marker and the float64 reference of x's int8 rounding."""
from __future__ import annotations

import pytest
import torch

from tokenmill import native

needs_int8_dot = pytest.mark.skipif(
    not (native.has_op("gguf_linear") and native.has_op("int8_linear") and native.has_op("int4_linear")
         and native.cpu_capability() in ("AVX2", "AVX512")),
    reason="tokenmill._C not built, or built without AVX2 (int8 activations need it)")


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> its int8 rounding per 32 columns as float64, in the kernels' float32 steps: d = max|x| / 127,
    q = round(x * (127 / max|x|)) (half to even)."""
    M, K = x.shape
    blocks = x.float().reshape(M, K // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    return (q.double() * (amax / 127.0).double()).reshape(M, K)
