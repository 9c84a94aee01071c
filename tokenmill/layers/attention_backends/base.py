"""The contract between the model runner and an attention backend.

Once per step the runner builds a `BatchLayout` (tensors only) and calls `build_metadata`; every
attention layer then calls `forward`, which writes this step's K/V into the layer's paged cache and
attends. The backend allocates the caches in the layout it prefers and owns their initialisation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention


@dataclass
class BatchLayout:
    """The packed batch as the runner builds it (request order; prompt chunks and decodes mixed)."""

    query_start: torch.Tensor  # [B] long, offset of each request's first new token in the packed batch
    query_len: torch.Tensor  # [B] long, new tokens per request (1 = decode)
    kv_len: torch.Tensor  # [B] long, tokens in the cache after this step (cached prefix + new)
    block_table: torch.Tensor  # [B, max_blocks] int64/int32, padded with 0 past each request's blocks
    slot_mapping: torch.Tensor  # [T] long, cache slot of each new token (block * block_size + offset)
    num_tokens: int
    max_query_len: int
    max_kv_len: int
    # Draft trees being verified (spec_decode/tree.py): tree_mask[r] [Nq, Nq] says which of request
    # tree_req[r]'s new tokens (its last token, then the tree's nodes) each of its queries may see (itself and
    # its ancestors; not causal order). None: every request is causal.
    tree_req: torch.Tensor | None = None  # [R] long, batch index of each request verifying a tree
    tree_mask: torch.Tensor | None = None  # [R, Nq, Nq] bool


@dataclass
class GroupedMetadata:
    """A step's metadata per KV cache group (executor/kv_groups.py): each layer reads `groups[layer.kv_group]`."""

    groups: list[Any]


class AttentionBackend:
    name: str = "base"
    # Per-head attention sinks (gpt-oss, Attention.sinks): a backend that does not add them to the softmax's
    # denominator refuses such layers when it allocates their cache (check_layers), never ignores them.
    supports_sinks: bool = False

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return False

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why the backend cannot run on `device` (None: it can), for the fallback's log line."""
        return None if cls.supports(device) else f"not supported on {torch.device(device).type}"

    @classmethod
    def describe(cls) -> str:
        """The backend as the start-up log names it."""
        return cls.name

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = torch.device(device)

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        raise NotImplementedError

    def bytes_per_block(self, layers: list[Attention], dtype: torch.dtype) -> int:
        """K and V bytes of one block over all layers (int8's per-slot scales included), for sizing the pool."""
        from tokenmill.layers.attention_backends.kv_quant import slot_scale_bytes

        per_layer = (torch.Size(self.kv_cache_shape(1, a.num_kv_heads, a.head_dim)).numel() for a in layers)
        slots = sum(self.block_size * a.num_kv_heads for a in layers)
        return 2 * sum(per_layer) * dtype.itemsize + 2 * slots * slot_scale_bytes(dtype)

    def allocate_kv_cache(self, layers: list[Attention], num_blocks: int, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def check_layers(self, layers: list[Attention], dtype: torch.dtype) -> None:
        """Refuse layers that need what this backend does not do (called first by allocate_kv_cache)."""
        if any(a.sinks is not None for a in layers) and not self.supports_sinks:
            raise ValueError(f"attention backend {self.name!r} has no attention sinks, which this model's "
                             f"attention layers use (gpt-oss); choose another --attention-backend")

    def mark_initialized(self, block_ids: torch.Tensor) -> None:
        """Blocks filled from outside a forward pass (KV transfer): lazy initialisation must keep them."""

    def build_metadata(self, layout: BatchLayout) -> Any:
        raise NotImplementedError

    def graph_buffers(self, max_batch: int, max_blocks: int, pad_block: int, max_query_len: int = 1) -> Any | None:
        """Fixed-address metadata for steps of up to max_batch requests of up to max_query_len tokens each replayed
        from CUDA graphs (executor/cuda_graphs.py: GraphBuffers), or None: this backend's steps build
        host-dependent metadata (or cannot take that many queries) and always run eagerly."""
        return None

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hk, D]. Writes k/v into the layer's cache, then attends: [T, H, D]."""
        raise NotImplementedError
