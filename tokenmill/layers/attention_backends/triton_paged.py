"""Paged attention in Triton (`triton_paged`): the CUDA default, and on the CPU under TRITON_INTERPRET=1 (where it
is tested against the float64 reference of the conformance suite and runs a tiny model end to end).

Same cache layout as torch_sdpa and cpu_paged ([num_blocks, block_size, Hk, D], int8's per-slot scales beside),
so KV transfer, prefix caching and the quantized formats work unchanged. Per layer: the step's K/V is written
into its slots (index_copy_ for float caches, kv_quant's reference quantizer for int8 / fp8), then one kernel
launch (triton_kernel.py) attends every request's queries, decodes and prompt chunks alike, over its keys read
through the block table: no gather, no padding to the longest request, no boolean mask, no device sync.
The launch's tiles (BLOCK_M query rows of one request each) are laid out on the CPU when the step's metadata is
built, once for all layers. Rows of requests verifying draft trees are attended again in torch with the tree
mask (torch_sdpa's group), as cpu_paged does.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.layers.attention_backends import kv_quant
from tokenmill.layers.attention_backends.base import AttentionBackend, BatchLayout
from tokenmill.layers.attention_backends.registry import register_backend
from tokenmill.layers.attention_backends.torch_sdpa import SDPAGroup, attend_group, tree_group

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, kv_quant.FP8)
BLOCK_M = 16  # query rows per program (tl.dot needs 16 or more)
BLOCK_N = 32  # key positions per inner step


def _triton_missing() -> str | None:
    # Found, not imported: Triton decides at import whether its language runs compiled or interpreted
    # (TRITON_INTERPRET), so nothing here may import it before a kernel is first launched.
    return "triton is not installed" if importlib.util.find_spec("triton") is None else None


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start: torch.Tensor  # [B] int32
    query_len: torch.Tensor  # [B] int32
    kv_len: torch.Tensor  # [B] int32
    tile_req: torch.Tensor  # [tiles] int32: the request of each program's BLOCK_M query rows
    tile_first: torch.Tensor  # [tiles] int32: its first row, counted within the request
    tree_group: SDPAGroup | None = None


@register_backend
class TritonPagedBackend(AttentionBackend):
    name = "triton_paged"

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return cls.unavailable_reason(device) is None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        missing = _triton_missing()
        if missing is not None:
            return missing
        kind = torch.device(device).type
        if kind == "cuda":
            return None
        if kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "CUDA only (on the CPU: under TRITON_INTERPRET=1, for tests)"

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, num_kv_heads, head_dim)

    def allocate_kv_cache(self, layers: list[Attention], num_blocks: int, dtype: torch.dtype) -> None:
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"triton_paged attention keeps its KV cache in float32, bfloat16 or float16 (or "
                             f"quantized: int8, float8_e4m3fn), not {dtype}")
        for a in layers:
            # Never zeroed: the kernel loads only keys below each request's kv_len.
            kv_quant.allocate(a, self.kv_cache_shape(num_blocks, a.num_kv_heads, a.head_dim), dtype, self.device)
            a.backend = self

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        i32, dev = torch.int32, self.device
        q_len = layout.query_len.to("cpu", torch.long)
        tiles = (q_len + BLOCK_M - 1) // BLOCK_M
        tile_req = torch.repeat_interleave(torch.arange(q_len.numel()), tiles)
        tile_first = (torch.arange(int(tiles.sum())) - torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles))
        to = lambda t: t.to(dev, i32).contiguous()  # noqa: E731
        return TritonMetadata(
            slot_mapping=layout.slot_mapping.to(dev, torch.long).contiguous(), block_table=to(layout.block_table),
            query_start=to(layout.query_start), query_len=to(layout.query_len), kv_len=to(layout.kv_len),
            tile_req=to(tile_req), tile_first=to(tile_first * BLOCK_M),
            tree_group=tree_group(layout, self.block_size, dev))

    def forward(self, layer: Attention, q, k, v, meta: TritonMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hk, D]. Returns [T, H, D] in q's dtype."""
        from tokenmill.layers.attention_backends import triton_kernel as tk

        k_cache, v_cache = layer.k_cache, layer.v_cache
        Hk, D = k_cache.shape[2], k_cache.shape[3]
        dtype = k_cache.dtype
        if kv_quant.is_quantized(dtype):
            kv_quant.write_reference(layer, k, v, meta.slot_mapping)
        else:
            k_cache.view(-1, Hk, D).index_copy_(0, meta.slot_mapping, k.to(dtype))
            v_cache.view(-1, Hk, D).index_copy_(0, meta.slot_mapping, v.to(dtype))
        fmt = tk.INT8 if dtype == torch.int8 else tk.FP8 if dtype == kv_quant.FP8 else tk.FLOAT
        if fmt == tk.FP8:  # its bits, decoded in the kernel
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        q = q.contiguous()
        out = torch.empty_like(q)
        if meta.tile_req.numel():
            tk.launch(q, k_cache, v_cache, layer.k_scale_cache, layer.v_scale_cache, out, meta.block_table,
                      meta.tile_req, meta.tile_first, meta.query_start, meta.query_len, meta.kv_len,
                      float(layer.scale), layer.logits_soft_cap, float(layer.k_scale), float(layer.v_scale),
                      layer.sliding_window, fmt, BLOCK_M, BLOCK_N)
        if meta.tree_group is not None:
            attend_group(layer, q, meta.tree_group, out)
        return out
