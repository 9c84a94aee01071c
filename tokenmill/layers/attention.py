"""Attention over the paged KV cache: write this step's K/V into the cache, then attend through
the backend. All layers write before they read within a step, so a request may attend to blocks
another request in the same batch is filling (prefix sharing)."""
from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Set by the model runner once the pool is allocated: [num_blocks, block_size, Hk, D].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hk, D] -> [T, H, D]."""
        kc = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        vc = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        return self.backend.forward(q, self.k_cache, self.v_cache, meta, self.sliding_window, self.scale)
