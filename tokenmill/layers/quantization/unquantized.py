"""Dense float weights: [output rows of this rank, input columns of this rank], F.linear.

Weights stay in the dtype they were loaded in. When that storage dtype differs from the compute dtype
(bf16 storage on a CPU without bf16 math), `apply` upcasts the weight per call, as the dense layers
always did: upcasting once at load would double the memory the user chose bf16 to save, and the
native kernels (csrc) are where a fused dequantize-in-registers GEMM belongs. When storage and compute
agree (the default fp32 path) it is one linear on the stored tensor, with no copy.

2-D float32 inputs on the CPU go to the native `dense_linear` (csrc/dense_linear.cpp) when the kernels
have it: for few rows it streams the weights near memory bandwidth, where SGEMM reaches a third of it,
and each row's result does not depend on the other rows; more rows go to at::linear inside the op.
TOKENMILL_DENSE_LINEAR=0 (read once) keeps F.linear.

bf16 / fp16 weights on a CPU with native math for them are packed once for oneDNN after loading
(onednn_pack.py): the layer's `weight` becomes the packed tensor and `apply` calls oneDNN on it."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import native
from tokenmill.layers.quantization import onednn_pack
from tokenmill.layers.quantization.base import NativeLinear, QuantizeMethodBase, set_weight_attrs


@functools.cache
def _dense_linear_op():
    """torch.ops.tokenmill.dense_linear, or None without the kernel or with TOKENMILL_DENSE_LINEAR=0 (once)."""
    if os.environ.get("TOKENMILL_DENSE_LINEAR") == "0" or not native.has_op("dense_linear"):
        return None
    return torch.ops.tokenmill.dense_linear.default


def dense_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) in x's dtype: dense_linear for 2-D float32 on the CPU, else F.linear (w upcast per call
    when stored in another dtype); a weight packed for oneDNN (onednn_pack.py) goes to oneDNN."""
    if w.is_mkldnn:
        return onednn_pack.packed_linear(x, w, bias)
    if x.dtype is torch.float32 and w.dtype is torch.float32 and x.dim() == 2 and x.is_cpu:
        op = _dense_linear_op()
        if op is not None:
            return op(x, w, bias)
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
        if bias is not None:
            bias = bias.to(x.dtype)
    return F.linear(x, w, bias)


class UnquantizedLinearMethod(QuantizeMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        if not onednn_pack.packable(w):
            return
        packed = nn.Parameter(onednn_pack.pack(w), requires_grad=False)
        set_weight_attrs(packed, vars(w))
        layer.weight = packed  # the plain weight is freed: one copy, not two

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense_matmul(x, layer.weight, bias)

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        w, b = layer.weight, layer.bias
        if w.dtype != torch.float32 or (b is not None and b.dtype != torch.float32):
            return None  # apply upcasts per call; the stack runs float32 weights as they are
        return NativeLinear("dense", w, b)
