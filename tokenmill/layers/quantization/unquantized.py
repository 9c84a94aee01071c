"""Dense float weights: [output rows of this rank, input columns of this rank], F.linear.

Weights stay in the dtype they were loaded in. When that storage dtype differs from the compute dtype
(bf16 storage on a CPU without bf16 math), `apply` upcasts the weight per call, as the dense layers
always did: upcasting once at load would double the memory the user chose bf16 to save, and the
native kernels (csrc) are where a fused dequantize-in-registers GEMM belongs. When storage and compute
agree (the default fp32 path) it is one F.linear on the stored tensor, with no copy."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantization.base import NativeLinear, QuantizeMethodBase, set_weight_attrs


class UnquantizedLinearMethod(QuantizeMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = layer.weight
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
            if bias is not None:
                bias = bias.to(x.dtype)
        return F.linear(x, w, bias)

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        w, b = layer.weight, layer.bias
        if w.dtype != torch.float32 or (b is not None and b.dtype != torch.float32):
            return None  # apply upcasts per call; the stack runs float32 weights as they are
        return NativeLinear("dense", w, b)
