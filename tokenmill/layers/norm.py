from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import fused


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. `offset=1.0` gives Gemma's (1 + weight) scaling."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype) if offset == 0.0 else torch.zeros(dim, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps, self.offset)

    def add(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, norm(x + h)): a residual add and this norm in one pass."""
        return fused.add_rms_norm(x, h, self.weight, self.eps, self.offset)
