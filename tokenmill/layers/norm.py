from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. `offset=1.0` gives Gemma's (1 + weight) scaling."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype) if offset == 0.0 else torch.zeros(dim, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        if self.offset:
            w = w + self.offset
        return (x * w).to(dtype)
