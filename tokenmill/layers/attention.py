"""Attention over the paged KV cache. The backend (layers/attention_backends) allocates the cache,
writes this step's K/V into it and attends. All layers write before they read within a step, so a
request may attend to blocks another request in the same batch is filling (prefix sharing).

An AttentionTimer attached to the layers (the model runner does it) sums the wall time spent inside the
backend over all layers of a step, for the diagnostics' attention time and achieved bandwidth."""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from tokenmill.layers.attention_backends.base import AttentionBackend, GroupedMetadata


class AttentionTimer:
    """Wall time inside the attention backend, summed over the layers it is attached to.

    `sync` makes each timed call synchronise the CUDA device before and after, so the time is the
    kernels' rather than their launch (costly: only when asked for). The owner resets `total` per step."""

    __slots__ = ("total", "sync")

    def __init__(self, sync: bool = False) -> None:
        self.total = 0.0
        self.sync = sync


class Attention(nn.Module):
    # MLA (layers/mla.py): V is the first features of K, so the layer keeps one cache (v_cache is k_cache) and its
    # KV bytes count once: kv_quant.allocate, layer_caches and layer_block_bytes read this.
    kv_shared: bool = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # gpt-oss: a learned logit per (this rank's) head that joins each softmax's denominator only (the
        # attention may go partly "nowhere"); float32, loaded from the checkpoint's self_attn.sinks.
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None
        # Set by AttentionBackend.allocate_kv_cache, in the backend's layout.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Quantized caches (attention_backends/kv_quant.py): int8's per-slot scales [num_blocks, block_size,
        # Hk], and fp8's per-layer scales (the checkpoint's self_attn.k_scale / v_scale, else 1.0).
        self.k_scale_cache: torch.Tensor | None = None
        self.v_scale_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.backend: AttentionBackend | None = None
        self.timer: AttentionTimer | None = None  # set by the model runner when attention is timed
        self.kv_group: int | None = None  # its KV cache group when the model has several (executor/kv_groups.py)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hk, D] -> [T, H, D]."""
        if type(meta) is GroupedMetadata:
            meta = meta.groups[self.kv_group]
        timer = self.timer
        if timer is None:
            return self.backend.forward(self, q, k, v, meta)
        if timer.sync:
            torch.cuda.synchronize(q.device)
        t = time.perf_counter()
        out = self.backend.forward(self, q, k, v, meta)
        if timer.sync:
            torch.cuda.synchronize(q.device)
        timer.total += time.perf_counter() - t
        return out
