"""Linear layers. Weights are stored in the model's storage dtype and used in the compute dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        b = self.bias
        if b is not None and b.dtype != x.dtype:
            b = b.to(x.dtype)
        return F.linear(x, w, b)


class MergedLinear(Linear):
    """Several projections of the same input in one GEMM (q/k/v, or gate/up). `sizes` are the output
    widths of the parts, loaded one at a time with `load_part`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, sum(sizes), bias, dtype)
        self.sizes = sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def load_part(self, index: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        lo, size = self.offsets[index], self.sizes[index]
        if weight is not None:
            if tuple(weight.shape) != (size, self.in_features):
                raise ValueError(f"weight part {index} has shape {tuple(weight.shape)}, expected {(size, self.in_features)}")
            self.weight.data[lo : lo + size].copy_(weight)
        if bias is not None:
            self.bias.data[lo : lo + size].copy_(bias)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.sizes, dim=-1))
