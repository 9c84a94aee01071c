"""bf16 / fp16 weights prepacked once for oneDNN's GEMM on the CPU.

`F.linear` on a bf16 weight hands oneDNN a plain [N, K] matrix every call, and oneDNN reorders it into its
blocked layout inside the call: at few rows that reorder costs as much as the product. Packing the weight
once at load (`torch.ops.mkldnn._reorder_linear_weight`, the same op inductor's CPU freezing uses) and
calling `torch.ops.mkldnn._linear_pointwise` on it measured, one thread, 2-core Zen 4 with avx512_bf16,
weights from DRAM (GFLOP/s, F.linear -> packed):
    [1536, 576]   M=1 21.5 -> 41.1, M=16 143 -> 189, M=64 197 -> 206, M=2048 204 -> 208
    [576, 1536]   M=1 21.6 -> 40.7, M=16 119 -> 189, M=64 181 -> 210, M=2048 209 -> 216
    [49152, 576]  M=1  7.8 -> 18.7, M=16  84 -> 133, M=64 153 -> 192, M=2048 163 -> 172
(docs/performance.md). The packed tensor is an opaque oneDNN tensor: shape, dtype and `to_dense()` work,
reading its values in any other way raises, so a packed weight replaces the plain one (no second copy) and
a stray reader fails loudly instead of reading garbage.

Only where oneDNN has the native math: bf16 needs avx512_bf16 / AMX (`_is_mkldnn_bf16_supported`), fp16
avx512_fp16 / AMX-FP16. float32 is not packed: `dense_linear` (csrc) is as fast or faster up to 32 rows, and
above that packing gained 5-10 % at the price of a second copy (dense_linear needs the plain one).
TOKENMILL_ONEDNN_PACK=0 (read once) keeps plain weights and F.linear."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def _enabled() -> bool:
    if os.environ.get("TOKENMILL_ONEDNN_PACK") == "0" or not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def _native_math(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes in `dtype` on this CPU (else it would emulate it, slower than upcasting)."""
    if dtype is torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype is torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def packable(w: torch.Tensor) -> bool:
    """A plain 2-D bf16/fp16 CPU weight that oneDNN multiplies natively here, with packing switched on."""
    return (_enabled() and w.device.type == "cpu" and w.layout is torch.strided and w.dim() == 2
            and w.numel() > 0 and _native_math(w.dtype))


def pack(w: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in oneDNN's blocked layout (an opaque tensor of the same shape and dtype)."""
    # The batch-size hint only tunes the layout; measured the same speed from 1 to 2048 rows with hint 1.
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) for a packed `w`, in x's dtype; x of any rank [..., K]."""
    if x.dtype != w.dtype:  # not the dtype it was packed for: unpack (slow, correct; not on any hot path)
        w = w.to_dense().to(x.dtype)
        return F.linear(x, w, bias.to(x.dtype) if bias is not None else None)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, w.shape[0])
    y = torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")
    return y.view(*lead, w.shape[0])
